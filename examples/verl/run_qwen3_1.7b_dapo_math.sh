#!/usr/bin/env bash
# GPPO on verl 0.9: Qwen3-1.7B-Base on DAPO-Math-17k, one node of 8 GPUs (see docs/verl.md).
#   pip install "gppo[verl]" "verl[vllm]==0.9.1"
#   bash examples/verl/run_qwen3_1.7b_dapo_math.sh [hydra overrides...]
# e.g. actor_rollout_ref.actor.policy_loss.loss_mode=gppo_dppo_binary_kl
#      actor_rollout_ref.actor.policy_loss.divergence=hellinger
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export GPPO_DATA_DIR="${GPPO_DATA_DIR:-$HOME/data/gppo}"
HF_DATA="https://huggingface.co/datasets/BytedTsinghua-SIA"

mkdir -p "$GPPO_DATA_DIR"
[ -f "$GPPO_DATA_DIR/dapo-math-17k.parquet" ] ||
  wget -O "$GPPO_DATA_DIR/dapo-math-17k.parquet" "$HF_DATA/DAPO-Math-17k/resolve/main/data/dapo-math-17k.parquet?download=true"
[ -f "$GPPO_DATA_DIR/aime-2024.parquet" ] ||
  wget -O "$GPPO_DATA_DIR/aime-2024.parquet" "$HF_DATA/AIME-2024/resolve/main/data/aime-2024.parquet?download=true"

# Fails before any GPU work if the plugin cannot be imported.
python -c "import gppo.integrations.verl"

python -m verl.trainer.main_ppo \
  --config-dir="$HERE/config" --config-name=qwen3_1.7b_dapo_math \
  "$@"
