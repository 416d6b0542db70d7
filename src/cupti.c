/* dlopen and dlsym of libcupti; no CUDA headers or libraries at build time. */
#define _GNU_SOURCE
#include "cupti.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

mvz_cupti mvz_cupti_api;

static const char *sonames[] = {"libcupti.so.13", "libcupti.so.12", "libcupti.so", NULL};

static void path_of(void *sym, char *path, size_t len)
{
    Dl_info info;
    if (sym && dladdr(sym, &info) && info.dli_fname)
        snprintf(path, len, "%s", info.dli_fname);
    else if (len)
        path[0] = 0;
}

int mvz_cupti_find_mapped(char *path, size_t len)
{
    for (int i = 0; sonames[i]; i++) {
        void *h = dlopen(sonames[i], RTLD_NOW | RTLD_NOLOAD);
        if (h) {
            path_of(dlsym(h, "cuptiGetVersion"), path, len);
            dlclose(h); /* drops only the reference NOLOAD added */
            return 1;
        }
    }
    return 0;
}

#define SYM(field, name, required)                                                          \
    do {                                                                                    \
        *(void **)(&mvz_cupti_api.field) = dlsym(h, name);                                        \
        if (required && !mvz_cupti_api.field) {                                                   \
            snprintf(err, errlen, "%s has no %s; it is not a usable libcupti", path ? path : \
                     "the mapped libcupti", name);                                          \
            goto fail;                                                                      \
        }                                                                                   \
    } while (0)

int mvz_cupti_load(const char *path, char *err, size_t errlen)
{
    if (mvz_cupti_api.handle) {
        snprintf(err, errlen, "libcupti is already loaded from %s", mvz_cupti_api.path);
        return -1;
    }
    void *h = NULL;
    if (path == NULL) {
        for (int i = 0; sonames[i] && !h; i++)
            h = dlopen(sonames[i], RTLD_NOW | RTLD_NOLOAD);
        if (!h) {
            snprintf(err, errlen, "no libcupti is mapped in this process");
            return -1;
        }
    } else {
        h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            const char *e = dlerror();
            snprintf(err, errlen, "%s", e ? e : "dlopen failed");
            return -1;
        }
    }
    memset(&mvz_cupti_api, 0, sizeof mvz_cupti_api);
    SYM(GetVersion, "cuptiGetVersion", 1);
    SYM(Subscribe, "cuptiSubscribe", 1);
    SYM(Subscribe_v2, "cuptiSubscribe_v2", 0);
    SYM(Unsubscribe, "cuptiUnsubscribe", 1);
    SYM(EnableCallback, "cuptiEnableCallback", 1);
    SYM(GetResultString, "cuptiGetResultString", 0);
    SYM(GetDeviceId, "cuptiGetDeviceId", 0);
    SYM(GetTimestamp, "cuptiGetTimestamp", 0);
    SYM(ActivityRegisterCallbacks, "cuptiActivityRegisterCallbacks", 0);
    SYM(ActivityEnable, "cuptiActivityEnable", 0);
    SYM(ActivityDisable, "cuptiActivityDisable", 0);
    SYM(ActivityFlushAll, "cuptiActivityFlushAll", 0);
    SYM(ActivityFlushPeriod, "cuptiActivityFlushPeriod", 0);
    SYM(ActivityGetNextRecord, "cuptiActivityGetNextRecord", 0);
    uint32_t v = 0;
    mvz_CUptiResult r = mvz_cupti_api.GetVersion(&v);
    if (r != MVZ_CUPTI_SUCCESS) {
        snprintf(err, errlen, "cuptiGetVersion failed: %s", mvz_cupti_result_string(r));
        goto fail;
    }
    mvz_cupti_api.version = v;
    mvz_cupti_api.handle = h;
    path_of(*(void **)&mvz_cupti_api.GetVersion, mvz_cupti_api.path, sizeof mvz_cupti_api.path);
    return 0;
fail:
    memset(&mvz_cupti_api, 0, sizeof mvz_cupti_api);
    dlclose(h);
    return -1;
}

const char *mvz_cupti_result_string(mvz_CUptiResult r)
{
    const char *s = NULL;
    if (mvz_cupti_api.GetResultString && mvz_cupti_api.GetResultString(r, &s) == MVZ_CUPTI_SUCCESS && s)
        return s;
    switch (r) {
    case MVZ_CUPTI_SUCCESS: return "CUPTI_SUCCESS";
    case MVZ_CUPTI_ERROR_NOT_INITIALIZED: return "CUPTI_ERROR_NOT_INITIALIZED";
    case MVZ_CUPTI_ERROR_INSUFFICIENT_PRIVILEGES: return "CUPTI_ERROR_INSUFFICIENT_PRIVILEGES";
    case MVZ_CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED:
        return "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED";
    default: return "CUPTI error";
    }
}
