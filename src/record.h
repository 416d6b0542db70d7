/* The allocation record: its fields written once.
 *
 * MVZ_RECORD_FIELDS below is the one list of what memviz records of an
 * allocation event. Everything else is generated from it:
 *   - mvz_alloc, the record in memory (the live table, peak sets, the trace
 *     ring, the flight recorder's base, a replay's live set);
 *   - mvz_event, the record in a .memviz file (packed, little-endian), its
 *     encoding (mvz_event_encode) and its decoding from the file's two
 *     layouts (mvz_event_read, mvz_event_read_planes);
 *   - Python's view of it: _core.EVENT_FIELDS, EVENT_FORMAT, EVENT_SIZE and
 *     RAW_EVENT_SIZE (module.c), from which memviz/trace/format.py builds
 *     its struct.
 *
 * Adding a field: add one line here (appended, so that older files, whose
 * records are a prefix of today's, still read: a field beyond a file's
 * record width reads as 0), fill it where it is known (store.c), and read
 * it where it is used (rows.c's AllocationRow, the Python model).
 *
 * Columns: X(name in memory, type in memory, name in the file, type in the
 * file, struct code of the file type, rule), where the rule says how the
 * file holds the value:
 *   SAME    the value, converted to the file's type;
 *   CLAMP   the value, or the file type's largest when it does not fit;
 *   DELTA   nanoseconds since the previous record of the stream (the
 *           timestamp; a TIME record restarts it where a delta would not
 *           fit 32 bits);
 *   DEVICE  the device number, -1 for pinned host memory (the store's
 *           MVZ_HOST_SLOT).
 * A bottom-floor header: types and inline functions only. */
#ifndef MEMVIZ_RECORD_H
#define MEMVIZ_RECORD_H

#include "types.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MVZ_RECORD_FIELDS(X)                                                           \
    X(timestamp, uint64_t, ts_delta, uint32_t, "I", DELTA)                             \
    X(op, uint8_t, op, uint8_t, "B", SAME)                                             \
    X(kind, uint8_t, kind, uint8_t, "B", SAME)                                         \
    X(slot, int16_t, device, int8_t, "b", DEVICE)                                      \
    X(flags, uint8_t, flags, uint8_t, "B", SAME)                                       \
    X(stack_id, uint32_t, stack_id, uint32_t, "I", SAME)                               \
    X(thread_idx, uint32_t, thread_idx, uint16_t, "H", CLAMP)                          \
    X(label_id, uint32_t, label_id, uint16_t, "H", CLAMP)                              \
    X(address, uint64_t, address, uint64_t, "Q", SAME)                                 \
    X(size, uint64_t, size, uint64_t, "Q", SAME)                                       \
    X(slack, uint64_t, slack, uint64_t, "Q", SAME)                                     \
    X(stream, uint64_t, stream, uint64_t, "Q", SAME)

/* What the fields hold:
 *   timestamp  ns on the store's clock; strictly increasing across the store
 *              (a block's may equal its segment's, store.h)
 *   op         MVZ_EV_*: ALLOC for a live allocation
 *   kind       MVZ_KIND_*
 *   slot       device number, or MVZ_HOST_SLOT
 *   flags      MVZ_FLAG_*
 *   stack_id   the interned Python stack; 0: no Python frames
 *   thread_idx index into the store's threads
 *   label_id   the thread's label then; 0: none
 *   address    device/host pointer, or the handle for PHYSICAL; FAILED: the
 *              CUresult; TIME: the absolute timestamp; GAP: events dropped
 *   size       bytes held: for a block of PyTorch's caching allocator, the
 *              block's size as PyTorch's allocator handed it out
 *   slack      size minus the bytes asked for (a block's rounding and the
 *              remainder PyTorch did not split off); 0 otherwise
 *   stream     the stream of a stream-ordered allocation or of raw memory
 *              PyTorch's allocator handed out on one, else 0 */

/* Event ops (the `op` field). */
enum mvz_event_op {
    MVZ_EV_ALLOC = 1,
    MVZ_EV_FREE = 2,
    MVZ_EV_FAILED = 3, /* address holds the CUresult */
    MVZ_EV_TIME = 4,   /* address holds the absolute timestamp (ns) */
    MVZ_EV_GAP = 5,    /* address holds how many events were dropped */
};

/* Flag bits (the `flags` field). */
#define MVZ_FLAG_BEFORE 0x01    /* live when tracking started: read from PyTorch at attach */
#define MVZ_FLAG_ESTIMATED 0x02 /* a block whose size PyTorch's rules could not fix
                                 * (expandable segments, a boundary table overflowed) */
#define MVZ_FLAG_MEMVIZ 0x04    /* memviz's own memory (the allocator route's probe) */
#define MVZ_FLAG_STREAM 0x08    /* a block another stream's use was recorded on (recordStream):
                                 * PyTorch takes it back only once that stream is done */
#define MVZ_FLAG_SYNTHETIC 0x80 /* a trace record made up, not seen (a flight base) */

#define MVZ_F_MEM(mname, mtype, fname, ftype, code, rule) mtype mname;
#define MVZ_F_FILE(mname, mtype, fname, ftype, code, rule) ftype fname;

/* An allocation event in memory. */
typedef struct {
    MVZ_RECORD_FIELDS(MVZ_F_MEM)
} mvz_alloc;

/* The same event in a .memviz file. */
#pragma pack(push, 1)
typedef struct {
    MVZ_RECORD_FIELDS(MVZ_F_FILE)
} mvz_event;
#pragma pack(pop)

#define MVZ_F_SIZE(mname, mtype, fname, ftype, code, rule) +sizeof(ftype)
enum { MVZ_EVENT_SIZE = 0 MVZ_RECORD_FIELDS(MVZ_F_SIZE) };
_Static_assert(sizeof(mvz_event) == MVZ_EVENT_SIZE, "a file record has no padding");
/* Format 1's records: the fields up to `size`. */
#define MVZ_EVENT_V1_SIZE 32
/* How far a compressed chunk of a .memviz file may inflate: at most
 * MVZ_MAX_RATIO times its compressed size plus MVZ_INFLATE_SLACK bytes. The
 * reader refuses more; every writer keeps under it (memviz/trace/format.py,
 * MAX_RATIO), so the reader's memory is bounded by the file's size. */
#define MVZ_MAX_RATIO 64
#define MVZ_INFLATE_SLACK 4096

/* ---- encoding ------------------------------------------------------------------------ */

#define MVZ_ENC_SAME(m, f, ft) e->f = (ft)a->m;
#define MVZ_ENC_CLAMP(m, f, ft) e->f = a->m > (ft) - 1 ? (ft) - 1 : (ft)a->m;
#define MVZ_ENC_DEVICE(m, f, ft) e->f = (ft)(a->m == MVZ_HOST_SLOT ? -1 : a->m);
#define MVZ_ENC_DELTA(m, f, ft)                                                         \
    {                                                                                   \
        uint64_t d_ = a->m >= *prev_ts ? a->m - *prev_ts : 0;                           \
        e->f = (ft)d_;                                                                  \
        *prev_ts += d_;                                                                 \
    }
#define MVZ_F_ENC(mname, mtype, fname, ftype, code, rule) MVZ_ENC_##rule(mname, fname, ftype)

/* One event into its file record; *prev_ts is the stream's clock (the caller
 * writes a TIME record first where the delta would not fit). Any thread, no
 * lock, no allocation. */
static inline void mvz_event_encode(mvz_event *e, const mvz_alloc *a, uint64_t *prev_ts)
{
    MVZ_RECORD_FIELDS(MVZ_F_ENC)
}

/* A record with op and address only (TIME, GAP). */
static inline void mvz_event_marker(mvz_event *e, int op, uint64_t address, int flags)
{
    memset(e, 0, sizeof *e);
    e->op = (uint8_t)op;
    e->address = address;
    e->flags = (uint8_t)flags;
}

/* ---- decoding ------------------------------------------------------------------------ */

static inline uint64_t mvz_le(const uint8_t *p, size_t n)
{
    uint64_t v = 0;
    for (size_t j = n; j-- > 0;)
        v = v << 8 | p[j];
    return v;
}

#define MVZ_F_READ(mname, mtype, fname, ftype, code, rule)                              \
    e->fname = offsetof(mvz_event, fname) + sizeof(ftype) <= width                      \
                   ? (ftype)mvz_le(b + offsetof(mvz_event, fname), sizeof(ftype))       \
                   : 0;

/* A file record of `width` bytes (little-endian, whatever this machine's
 * order) into its fields; fields past the width (an older format) are 0. */
static inline void mvz_event_read(const uint8_t *b, size_t width, mvz_event *e)
{
    MVZ_RECORD_FIELDS(MVZ_F_READ)
}

/* Byte planes (layout 1): byte j of record i of `count` is at
 * records[j * count + i]. Field by field over records k..k+m-1 into ev[],
 * each field one plane at a time, so each loop reads runs of bytes (and
 * vectorises); `f` is a caller's scratch array of m numbers
 * (mvz_event_read_planes, below). */
static inline void mvz_plane_field(const uint8_t *records, size_t count, size_t k, size_t m,
                                   size_t lo, size_t n, uint64_t *out)
{
    for (size_t i = 0; i < m; i++)
        out[i] = 0;
    for (size_t b = n; b-- > 0;) {
        const uint8_t *plane = records + (lo + b) * count + k;
        for (size_t i = 0; i < m; i++)
            out[i] = out[i] << 8 | plane[i];
    }
}
#define MVZ_F_PLANES(mname, mtype, fname, ftype, code, rule)                            \
    if (offsetof(mvz_event, fname) + sizeof(ftype) <= width_) {                         \
        mvz_plane_field(records_, count_, k_, m_, offsetof(mvz_event, fname),           \
                        sizeof(ftype), f_);                                             \
        for (size_t i_ = 0; i_ < m_; i_++)                                              \
            ev_[i_].fname = (ftype)f_[i_];                                              \
    } else {                                                                            \
        for (size_t i_ = 0; i_ < m_; i_++)                                              \
            ev_[i_].fname = 0;                                                          \
    }
static inline void mvz_event_read_planes(const uint8_t *records_, size_t count_, size_t width_,
                                         size_t k_, size_t m_, mvz_event *ev_, uint64_t *f_)
{
    MVZ_RECORD_FIELDS(MVZ_F_PLANES)
}

/* One field of record i of `count` records of `width` bytes (layout 0: one
 * after another, 1: byte planes), little-endian, 0 past the width (an
 * older format): for a reader that needs a few fields of some records only
 * (whatif_pass.c). MVZ_EVENT_FIELD names the field as mvz_event does. */
static inline uint64_t mvz_event_field(const uint8_t *records, size_t count, size_t width, int layout,
                                       size_t i, size_t lo, size_t n)
{
    if (lo + n > width)
        return 0;
    if (layout == 0)
        return mvz_le(records + i * width + lo, n);
    uint64_t v = 0;
    for (size_t b = n; b-- > 0;)
        v = v << 8 | records[(lo + b) * count + i];
    return v;
}
#define MVZ_EVENT_FIELD(records, count, width, layout, i, fname)                                 \
    mvz_event_field((records), (count), (width), (layout), (i), offsetof(mvz_event, fname),     \
                    sizeof(((const mvz_event *)0)->fname))

/* The in-memory record of a decoded event, dated `ts` (the stream's clock
 * after it); the device -1 stays -1 (a replay's slots are its own). */
#define MVZ_DEC_SAME(m, f) a->m = e->f;
#define MVZ_DEC_CLAMP(m, f) a->m = e->f;
#define MVZ_DEC_DEVICE(m, f) a->m = e->f;
#define MVZ_DEC_DELTA(m, f) a->m = ts;
#define MVZ_F_DEC(mname, mtype, fname, ftype, code, rule) MVZ_DEC_##rule(mname, fname)
static inline void mvz_event_decode(mvz_alloc *a, const mvz_event *e, uint64_t ts)
{
    MVZ_RECORD_FIELDS(MVZ_F_DEC)
}

#endif
