export MOEFORGE_CACHE_DIR=$(mktemp -d)
B=target/release/moeforge
$B selftest --gpu 2>&1 | tail -5
for round in 1 2; do $B bench --gpu --pack-only --reps 20 2>&1 | tail -14; done
CUDA_CACHE_DISABLE=1 $B bench --gpu --recipe nvfp4_cutedsl 2>&1 | grep -A3 "JIT"
