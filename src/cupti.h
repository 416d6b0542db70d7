/* libcupti, loaded at run time with dlopen (docs/architecture.md, rule 5). */
#ifndef MEMVIZ_CUPTI_H
#define MEMVIZ_CUPTI_H

#include <stddef.h>
#include <stdint.h>

#include "cupti_abi.h"

typedef struct {
    void *handle;
    char path[4096]; /* the file actually mapped (dladdr), for capture_info */
    uint32_t version;
    mvz_CUptiResult (*GetVersion)(uint32_t *);
    mvz_CUptiResult (*Subscribe)(mvz_CUpti_SubscriberHandle *, mvz_CUpti_CallbackFunc, void *);
    mvz_CUptiResult (*Subscribe_v2)(mvz_CUpti_SubscriberHandle *, mvz_CUpti_CallbackFunc, void *,
                                    mvz_CUpti_SubscriberParams *);
    mvz_CUptiResult (*Unsubscribe)(mvz_CUpti_SubscriberHandle);
    mvz_CUptiResult (*EnableCallback)(uint32_t, mvz_CUpti_SubscriberHandle, int, uint32_t);
    mvz_CUptiResult (*GetResultString)(mvz_CUptiResult, const char **);
    mvz_CUptiResult (*GetDeviceId)(mvz_CUcontext, uint32_t *);
    mvz_CUptiResult (*GetTimestamp)(uint64_t *);
    mvz_CUptiResult (*ActivityRegisterCallbacks)(mvz_BuffersCallbackRequestFunc,
                                                 mvz_BuffersCallbackCompleteFunc);
    mvz_CUptiResult (*ActivityEnable)(int);
    mvz_CUptiResult (*ActivityDisable)(int);
    mvz_CUptiResult (*ActivityFlushAll)(uint32_t);
    mvz_CUptiResult (*ActivityFlushPeriod)(uint32_t);
    mvz_CUptiResult (*ActivityGetNextRecord)(uint8_t *, size_t, void **);
} mvz_cupti;

extern mvz_cupti mvz_cupti_api;

/* Whether a libcupti is already mapped into the process under one of the
 * usual sonames; fills `path` with its file. */
int mvz_cupti_find_mapped(char *path, size_t len);

/* Load libcupti from `path` (NULL: a copy already mapped). Returns 0, or -1
 * with a sentence in `err`. Loading twice is refused (never two copies). */
int mvz_cupti_load(const char *path, char *err, size_t errlen);

const char *mvz_cupti_result_string(mvz_CUptiResult r);

#endif
