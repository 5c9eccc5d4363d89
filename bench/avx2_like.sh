#!/usr/bin/env bash
# Run a command roughly as the 2-core AVX2 machine would: a projection, never a figure for that machine.
#
#   bash bench/avx2_like.sh make test-main                 (as root)
#   AGL_CPU_SHARE=0.5 bash bench/avx2_like.sh .venv/bin/python harness.py task=sums algo=grpo
#
# Two differences are emulated, on a faster x86 CPU where this shell is root:
#   - no native bf16: /proc/cpuinfo is replaced, in a private mount namespace, by a copy without the
#     avx512_bf16 and amx_bf16 flags, so `model.compute_dtype=auto` resolves to float32 as it does there
#     (agl/policy/load.py). torch's own kernels still use what the CPU has; its float32 matmuls ran no faster
#     with AVX512 than capped at AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2:
#     204 GFLOP/s, against 197 uncapped).
#   - a slower CPU: the command and its children get AGL_CPU_SHARE (default 0.5) of all the machine's cores'
#     time, the CFS quota of a cgroup-v1 `cpu` group of their own (period 10 ms). On the 2-core AVX512-bf16
#     machine, 0.5 puts the float32 2048^2 matmul probe at 102 GFLOP/s, within the AVX2 machine's 87-108, and
#     the test suite took ~2x as long there as here (38 min against 17-19 min, docs/benchmarks-history.md).
# Not emulated: the AVX2 machine's memory bandwidth and caches (13.5 GB/s measured there), and the bursts a
# quota allows (all cores run at once for part of each period), so latency-bound parts are not slowed the same.
# cgroup v1 only (a cgroup-v2 machine would set cpu.max instead).
set -euo pipefail

if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  echo "avx2_like.sh: run it, do not source it (it would move this shell into the group)" >&2
  return 2
fi
if [ $# -eq 0 ]; then
  echo "usage: bash bench/avx2_like.sh COMMAND [ARG...]   (AGL_CPU_SHARE: the share of the CPU, default 0.5)" >&2
  exit 2
fi
if [ ! -w /sys/fs/cgroup/cpu ] || ! command -v unshare >/dev/null; then
  echo "avx2_like.sh: needs root, a writable cgroup-v1 cpu controller (/sys/fs/cgroup/cpu) and unshare" >&2
  exit 2
fi

share=${AGL_CPU_SHARE:-0.5}
period_us=10000
quota_us=$(awk -v s="$share" -v n="$(nproc --all)" -v p="$period_us" 'BEGIN { printf "%d", s * n * p }')
if [ "$quota_us" -lt 1000 ]; then
  echo "avx2_like.sh: AGL_CPU_SHARE=$share is too small (CFS quotas start at 1 ms a period)" >&2
  exit 2
fi
group=/sys/fs/cgroup/cpu/agl-avx2-like.$$
cpuinfo=$(mktemp)
cleanup() {
  echo $$ >/sys/fs/cgroup/cpu/cgroup.procs  # back to the root group, so that this one can go
  rmdir "$group" 2>/dev/null || true          # not while a child the command left behind still runs in it
  rm -f "$cpuinfo"
}
trap cleanup EXIT
mkdir "$group"
echo "$period_us" >"$group/cpu.cfs_period_us"
echo "$quota_us" >"$group/cpu.cfs_quota_us"
echo $$ >"$group/cgroup.procs"  # this shell, and so the command and all it starts

sed -e 's/ avx512_bf16//g' -e 's/ amx_bf16//g' /proc/cpuinfo >"$cpuinfo"
echo "avx2_like.sh: $share of $(nproc --all) cores ($group), /proc/cpuinfo without bf16 flags" >&2
unshare -m bash -c 'mount --bind "$0" /proc/cpuinfo && exec "$@"' "$cpuinfo" "$@"
