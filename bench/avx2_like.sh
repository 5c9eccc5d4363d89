#!/usr/bin/env bash
# Run a command roughly as the 2-core AVX2 machine would: a projection, never a figure for that machine.
#
#   sudo bash bench/avx2_like.sh make test-main
#   AGL_CPU_SHARE=0.5 bash bench/avx2_like.sh .venv/bin/python harness.py task=sums algo=grpo
#
# Two differences are emulated, on a faster x86 CPU where this shell is root:
#   - no native bf16: /proc/cpuinfo is replaced, in a private mount namespace, by a copy without the
#     avx512_bf16 and amx_bf16 flags, so `model.compute_dtype=auto` resolves to float32 as it does there
#     (agl/policy/load.py; torch's own kernels still use what the CPU has: float32 matmuls run as fast);
#   - a slower CPU: the command and its children get AGL_CPU_SHARE (default 0.5) of the two cores' time, a
#     CFS quota of a cgroup-v1 `cpu` group (period 10 ms). On the AVX512-bf16 machine, 0.5 puts the float32
#     2048^2 matmul probe near the AVX2 machine's 87-108 GFLOP/s and matches its test suite's ~2x (38 min
#     there against 17-19 min here, at the same commit's layout: docs/benchmarks-history.md).
# Not emulated: the AVX2 machine's memory bandwidth and caches (13.5 GB/s measured there), and the bursts a
# quota allows (both cores run at once for 5 ms of each 10 ms), so latency-bound parts are not slowed the same.
set -euo pipefail

share=${AGL_CPU_SHARE:-0.5}
period_us=10000
group=/sys/fs/cgroup/cpu/agl-avx2-like
if [ ! -w /sys/fs/cgroup/cpu ] || ! command -v unshare >/dev/null; then
  echo "avx2_like.sh: needs root, a writable cgroup-v1 cpu controller (/sys/fs/cgroup/cpu) and unshare" >&2
  exit 2
fi
mkdir -p "$group"
echo "$period_us" >"$group/cpu.cfs_period_us"
awk -v s="$share" -v n="$(nproc)" -v p="$period_us" 'BEGIN { printf "%d\n", s * n * p }' >"$group/cpu.cfs_quota_us"
echo $$ >"$group/cgroup.procs"  # this shell, and so the command and all it starts

cpuinfo=$(mktemp)
trap 'rm -f "$cpuinfo"' EXIT
sed -e 's/ avx512_bf16//g' -e 's/ amx_bf16//g' /proc/cpuinfo >"$cpuinfo"
echo "avx2_like.sh: $share of $(nproc) cores (cgroup $group), /proc/cpuinfo without bf16 flags" >&2
unshare -m bash -c 'mount --bind "$0" /proc/cpuinfo && exec "$@"' "$cpuinfo" "$@"
