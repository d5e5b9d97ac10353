// Token events from the runtime's USDT probe zerolayer:token (bpf/_probes.c) to user space.
//
// bcc style: the loader (bpf/loader.py) fills the placeholders in capitals and prints the result
// with --print-bpf. Each event gains the kernel's view: a CLOCK_MONOTONIC timestamp, the cgroup
// id of the emitting task and its pid. Events go through one BPF ring buffer; an event that finds
// the buffer full is counted in `lost`, never dropped silently. Size the ring for the node's peak
// event rate times the drain interval (events are ~300 bytes).
#include <uapi/linux/ptrace.h>

#define TENANT_LEN 64
#define MODEL_LEN 128
#define REQUEST_ID_LEN 64

struct token_event {
    u64 runtime_id;
    u64 seq;
    u64 ktime_ns;
    u64 cgroup_id;
    u32 pid;
    u32 input_tokens;
    u32 output_tokens;
    u32 flags;
    char tenant[TENANT_LEN];
    char model[MODEL_LEN];
    char request_id[REQUEST_ID_LEN];
};

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_PERCPU_ARRAY(lost, u64, 1);
// Filters, filled by user space: attach by process (tgid) or by cgroup (id = cgroup v2 inode).
BPF_HASH(target_pids, u32, u8, 4096);
BPF_HASH(target_cgroups, u64, u8, 4096);

int on_token(struct pt_regs *ctx)
{
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    u64 cgroup_id = bpf_get_current_cgroup_id();
    if (FILTER_PIDS && !target_pids.lookup(&pid))
        return 0;
    if (FILTER_CGROUPS && !target_cgroups.lookup(&cgroup_id))
        return 0;

    struct token_event *e = events.ringbuf_reserve(sizeof(struct token_event));
    if (!e) {
        int zero = 0;
        u64 *count = lost.lookup(&zero);
        if (count)
            *count += 1;
        return 0;
    }
    u64 ptr = 0;
    e->ktime_ns = bpf_ktime_get_ns();
    e->cgroup_id = cgroup_id;
    e->pid = pid;
    bpf_usdt_readarg(1, ctx, &e->runtime_id);
    bpf_usdt_readarg(2, ctx, &e->seq);
    bpf_usdt_readarg(3, ctx, &ptr);
    bpf_probe_read_user_str(e->tenant, sizeof(e->tenant), (void *)ptr);
    bpf_usdt_readarg(4, ctx, &ptr);
    bpf_probe_read_user_str(e->model, sizeof(e->model), (void *)ptr);
    bpf_usdt_readarg(5, ctx, &ptr);
    bpf_probe_read_user_str(e->request_id, sizeof(e->request_id), (void *)ptr);
    bpf_usdt_readarg(6, ctx, &e->input_tokens);
    bpf_usdt_readarg(7, ctx, &e->output_tokens);
    bpf_usdt_readarg(8, ctx, &e->flags);
    // No wakeup: user space drains on a timer (bpf/loader.py), so a busy runtime never pays for waking it.
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}
