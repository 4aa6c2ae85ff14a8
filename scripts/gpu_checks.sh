#!/usr/bin/env bash
# The checks and benchmarks that need a GPU, as one prepared run: each step under its own timeout,
# its output in $OUT/<step>.log (default ./gpu-checks), one line per step in $OUT/summary.txt, so
# a run cut short still leaves what it did.
#
#   scripts/gpu_checks.sh optim server         # (also with no step named) at most 7 minutes: its limits' sum
#   scripts/gpu_checks.sh round                # at most 5; every other step: 5 each (round-mps 9)
#
# On an NVIDIA H100 (16 cores) server took 31 s, round 136 s and units 269 s; on an H200 optim took 80 s,
# server 33 s, round-mps 243 s, units 269 s and round-bf16 131 s, and deploy ran its first of three modes in
# 54 s (it needs most of its 5 minutes). A machine's start takes about 35 s of the device time, and the
# first call on a machine installs .gpu/ in about 25 s: an outer `timeout` must leave room for both. Each step writes one log (optim and server
# two), beside summary.txt and machine.txt.
#
# Steps (docs/PERFORMANCE.md says what each one measures and its targets):
#   optim           the optimizer's CUDA tests, then bench_optimizer.py on CUDA, with a kernel profile per scope
#   optim-compiled  the same for compile=True (the compiled passes and the counting selection), beside the
#                   defaults in one benchmark run: at most 9 minutes (each layout compiles at its first step)
#   server          the server round's tests (their cuda case), then bench_server.py on CUDA
#   round           bench_round.py --paper: the seed's round, GPU busy share, 300-round projection
#   round-compiled  the same with compile_model=reduce-overhead (CUDA graphs)
#   round-2-actors  the seed's round with 0.5 GPU a client: 2 actors, 5 clients one after another in each
#   round-batched   the seed's round with client_batch=true, CUDA graphs and bf16: its ten clients trained at once by
#                   one process (ClientBatch); first ClientBatch's float32 CUDA test at ViT-Tiny's shapes: at most 6 minutes
#   client-batch    bench_client_batch.py --paper: the seed's round's clients trained at once (vmap) against one
#                   after another in one process, float32 with its operation and kernel counts, then both sides
#                   with CUDA graphs and bf16 (compile_model=reduce-overhead precision=bf16), each with the batched
#                   step's optimizer alone: at most 8 minutes
#   round-bf16      the seed's round with CUDA graphs and bf16 autocast (tensor cores): the fastest settings
#   round-bytes     round-bf16 with the broadcast and the replies in bfloat16 (wire_dtype, reply_dtype): 0.6 of
#                   the round's bytes; compare with round-bf16's figures (a pair: run both in one call)
#   round-mps       round-bf16, then the same with the clients under a private CUDA MPS daemon (--mps), on
#                   one machine (a pair to compare): at most 9 minutes
#   units           the unit tests (not the Flower runs) with the GPU visible, and that pytest exits
#   deploy          bench_deploy.py: 4 SuperNodes on the GPU, warm workers against both of Flower's floors
#
# A machine without flwr, Ray or Hydra gets them from .gpu/ (../shared/gpu/make_kit.sh builds it).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-checks}
mkdir -p "$out"
[ -f .gpu/setup.sh ] && source .gpu/setup.sh
if [ -d /tmp/site ] && [ ! -f /tmp/site/.compiled ]; then  # the kit installs --no-compile; pip compiles a user's
    python3 -m compileall -q -j 0 /tmp/site >/dev/null 2>&1  # install: so the start-up times are a user's
    touch /tmp/site/.compiled
fi
if [ -d /tmp/site/ray ] && ! command -v ray >/dev/null; then  # the kit's Ray comes without its console script
    printf '#!%s\nfrom ray.scripts.scripts import main\nmain()\n' "$(command -v python3)" >/tmp/site/bin/ray
    chmod +x /tmp/site/bin/ray
fi
python3 -c "import optuna" 2>/dev/null || echo "no optuna here: tests/test_tune.py cannot be imported (the kit needs \
its wheels: pip download --no-deps optuna colorlog into .gpu/whl)" | tee -a "$out/summary.txt"
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1

step() {  # step NAME SECONDS COMMAND...: run COMMAND under a timeout, log to $out/NAME.log
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "== $name (limit ${limit} s): $*" | tee -a "$out/summary.txt"
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "   rc=$rc after $(($(date +%s) - start)) s" | tee -a "$out/summary.txt"
    tail -n 25 "$out/$name.log"
}

DEPLOY_OVERRIDES="dataset=synthetic dataset.num_classes=100 dataset.image_size=32 dataset.channels=3 \
dataset.mean=[0.5,0.5,0.5] dataset.std=[0.25,0.25,0.25] model=vit_tiny num_clients=4 fraction_train=1.0 \
min_train_nodes=4 num_rounds=5 local_steps=20 device=cuda"

{ nvidia-smi; python3 -c "import sys, torch; print(sys.version, torch.__version__)"; lscpu | grep 'Model name'; } \
    >"$out/machine.txt" 2>&1
for name in "${@:-optim server}"; do
    for one in $name; do
        case $one in
        optim)
            step optim-tests 120 python3 -m pytest -n 0 -p no:cacheprovider -q tests/test_optim.py \
                tests/test_optim_topk.py tests/test_compile_model.py -k "cuda and not compiled_steps and not counting"
            step bench-optimizer 150 python3 scripts/bench_optimizer.py --device cuda --repeats 50 --train-repeats 20 \
                --profile 20 ;;
        optim-compiled)  # compile=True: the compiled passes and the counting selection (topk._CountSelect)
            step optim-compiled-tests 300 python3 -m pytest -n 0 -p no:cacheprovider -q tests/test_optim.py \
                tests/test_optim_topk.py -k "cuda and (compiled_steps or counting)"
            step bench-optimizer-compiled 240 python3 scripts/bench_optimizer.py --device cuda --compile \
                --repeats 50 --train-repeats 20 --profile 20 ;;
        server)
            step server-tests 60 python3 -m pytest -n 0 -p no:cacheprovider -q tests/test_server_round.py
            step bench-server 90 python3 scripts/bench_server.py --device cuda --repeats 20 ;;
        round) step bench-round-paper 300 python3 scripts/bench_round.py --paper ;;
        round-compiled)
            step bench-round-compiled 300 python3 scripts/bench_round.py --paper --overrides "compile_model=reduce-overhead" ;;
        round-bf16)
            step bench-round-bf16 300 python3 scripts/bench_round.py --paper \
                --overrides "compile_model=reduce-overhead precision=bf16" ;;
        round-bytes)
            step bench-round-bytes 300 python3 scripts/bench_round.py --paper \
                --overrides "compile_model=reduce-overhead precision=bf16 wire_dtype=bfloat16 reply_dtype=bfloat16" ;;
        round-mps)
            if ! command -v nvidia-cuda-mps-control >/dev/null; then
                echo "== round-mps: no nvidia-cuda-mps-control on PATH, nothing to compare" | tee -a "$out/summary.txt"
                continue
            fi
            step bench-round-mps-baseline 270 python3 scripts/bench_round.py --paper \
                --overrides "compile_model=reduce-overhead precision=bf16"
            # nvidia-smi's process table in the rounds: under MPS it lists nvidia-cuda-mps-server and
            # the clients as type M+C
            (sleep 70; nvidia-smi) >"$out/nvidia-smi-mps.txt" 2>&1 &
            step bench-round-mps 270 python3 scripts/bench_round.py --paper --mps \
                --overrides "compile_model=reduce-overhead precision=bf16" ;;
        round-2-actors) step bench-round-2-actors 300 python3 scripts/bench_round.py --paper --num-gpus 0.5 ;;
        round-batched)  # client_batch=true: the round's ten clients trained at once by the machine's batching worker
            step client-batch-vit-tiny-test 60 python3 -m pytest -n 0 -p no:cacheprovider -q tests/test_client_batch.py \
                -k vit_tiny_shapes
            step bench-round-batched 300 python3 scripts/bench_round.py --paper \
                --overrides "client_batch=true compile_model=reduce-overhead precision=bf16" ;;
        client-batch)  # the seed's round's ten clients trained at once (ClientBatch) against one after another
            step client-batch-tests 120 python3 -m pytest -n 0 -p no:cacheprovider -q tests/test_client_batch.py -k cuda
            step bench-client-batch 150 python3 scripts/bench_client_batch.py --paper --profile
            step bench-client-batch-compiled 180 python3 scripts/bench_client_batch.py --paper --rounds 4 \
                --overrides "compile_model=reduce-overhead precision=bf16" ;;
        units)  # -v: every test's outcome as it ends, so a run cut short still names its failures
            step units 300 python3 -m pytest -n 4 -p no:cacheprovider -v -rfE -m "not e2e" ;;
        deploy)
            step bench-deploy 300 python3 scripts/bench_deploy.py --overrides "$DEPLOY_OVERRIDES" --cuda-devices 0 \
                --modes floor,floor-distinct,warm ;;
        *) echo "unknown step $one: allowed optim optim-compiled server round round-compiled round-bf16 round-bytes" \
                "round-mps round-2-actors round-batched client-batch units deploy" >&2; exit 2 ;;
        esac
    done
done
