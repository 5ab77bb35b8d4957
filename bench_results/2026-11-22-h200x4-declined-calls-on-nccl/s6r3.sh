# session 6, run 3 (4 x H200): where a 1 MiB hot all_to_all's time goes (cProfile of rank 0), then
# the 1 MiB hot bench and MoE 64 MiB with declined calls on NCCL itself
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export LOGS=/tmp/L BENCH_TIMEOUT=200; rm -rf $LOGS; mkdir -p $LOGS
S="bash scripts/device_run.sh"
timeout 100 python3 scripts/profile_call.py --nproc 4 --op all_to_all_single --hot 0.7 --size 1M --shares auto 2>&1 | grep -v Warning > $LOGS/profile_hot1m_auto.log; grep -v "^\[rank" $LOGS/profile_hot1m_auto.log | head -75
BENCH_OP=all_to_all_single BENCH_SIZES=1M:1M BENCH_TAG=hot_1m BENCH_EXTRA="--hot-fraction 0.7,1.0 --no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
BENCH_OP=moe BENCH_SIZES=64M:64M BENCH_TAG=moe BENCH_EXTRA="--no-calibrate" $S bench4 | grep -E "^ +[0-9]|^# [a-z]"
$S pack
