// Token events from the runtime's USDT probe zerolayer:tokens (bpf/_probes.c) to user space.
//
// bcc style: the loader (bpf/loader.py) fills the placeholders in capitals and prints the result
// with --print-bpf. The runtime fires the probe once per event-loop iteration with a batch of
// token events (journal-format records, ~110 bytes each). The program keeps only the processes or
// cgroups it is told about, copies the batch from the runtime's memory and adds the kernel's view:
// a CLOCK_MONOTONIC timestamp, the cgroup id of the emitting task and its pid. Batches go through
// one BPF ring buffer; a batch that finds the buffer full is counted in `lost` (by its events),
// never dropped silently. Size the ring for the node's peak token rate times the drain interval.
#include <uapi/linux/ptrace.h>

#define MAX_BATCH 16384  // a batch holds fewer bytes than this (MAX_BATCH in bpf/_probes.c)

struct batch_header {
    u64 ktime_ns;
    u64 cgroup_id;
    u32 pid;
    u32 count;  // events in the batch
    u32 len;    // bytes of records that follow
    u32 pad;
};

struct batch {
    struct batch_header h;
    char data[MAX_BATCH];
};

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
// [0] events lost to a full ring buffer, [1] batches the program could not read (too large, unmapped).
BPF_PERCPU_ARRAY(lost, u64, 2);
// 16 KiB does not fit the 512-byte BPF stack (and a per-CPU value is at most 32 KiB): one scratch batch per CPU.
BPF_PERCPU_ARRAY(scratch, struct batch, 1);
// Filters, filled by user space: attach by process (tgid) or by cgroup (id = cgroup v2 inode). A cgroup
// selects every task in it or below it: a pod's cgroup covers its containers, restarted ones too.
BPF_HASH(target_pids, u32, u8, 4096);
BPF_HASH(target_cgroups, u64, u8, 4096);

#define MAX_CGROUP_DEPTH 16

static __always_inline int in_target_cgroup(u64 cgroup_id)
{
    if (target_cgroups.lookup(&cgroup_id))
        return 1;
#pragma unroll
    for (int level = 0; level < MAX_CGROUP_DEPTH; level++) {
        u64 id = bpf_get_current_ancestor_cgroup_id(level);
        if (id == 0 || id == cgroup_id)
            return 0;  // past the task's own level
        if (target_cgroups.lookup(&id))
            return 1;
    }
    return 0;
}

static __always_inline void count_lost(int slot, u64 n)
{
    u64 *total = lost.lookup(&slot);
    if (total)
        *total += n;
}

int on_tokens(struct pt_regs *ctx)
{
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    u64 cgroup_id = bpf_get_current_cgroup_id();
    if (FILTER_PIDS && !target_pids.lookup(&pid))
        return 0;
    if (FILTER_CGROUPS && !in_target_cgroup(cgroup_id))
        return 0;

    u64 ptr = 0, len = 0;
    u32 count = 0;
    bpf_usdt_readarg(1, ctx, &ptr);
    bpf_usdt_readarg(2, ctx, &len);
    bpf_usdt_readarg(3, ctx, &count);
    int zero = 0;
    struct batch *b = scratch.lookup(&zero);
    if (!b)
        return 0;
    // Batches are smaller than MAX_BATCH (the runtime fires at 8 KiB); the mask tells the verifier so.
    if (len == 0 || len >= MAX_BATCH || bpf_probe_read_user(b->data, len & (MAX_BATCH - 1), (void *)ptr)) {
        count_lost(1, 1);
        count_lost(0, count);
        return 0;
    }
    b->h.ktime_ns = bpf_ktime_get_ns();
    b->h.cgroup_id = cgroup_id;
    b->h.pid = pid;
    b->h.count = count;
    b->h.len = len;
    // No wakeup: user space drains on a timer (bpf/loader.py), so a busy runtime never pays for waking it.
    if (events.ringbuf_output(b, sizeof(struct batch_header) + (len & (MAX_BATCH - 1)), BPF_RB_NO_WAKEUP))
        count_lost(0, count);
    return 0;
}
