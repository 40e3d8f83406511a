"""Launched by tests/test_trl_multiprocess.py as `accelerate launch --multi_gpu --num_processes 2
tests/trl_multiprocess_job.py MODEL_DIR CHAT_MODEL_DIR RESULT_FILE` (torchrun's launcher;
use_cpu=True makes the process group gloo): the same 2-step training run of TRL's GRPOTrainer
(loss_type "dapo"), GPPOTrainer (gppo_preset "ppo") and GPPOTrainer (a top-K preset) in two CPU
processes, two micro-batches per optimizer step, one generation batch for both steps; then the
first two and dppo-topk-kl again with a LoRA adapter (TRL's peft_config; skipped without peft), and
the first two with TRL's `tools` (CHAT_MODEL_DIR: tests/trl_tools.py's chat model, whose first turn
calls the tool). Rank 0 saves to RESULT_FILE, for each run: its final weights (with an adapter: the
adapter's and the base's apart) and log history, and every rank's per-micro-batch count of the
completion tokens the loss sees (the model's: tool tokens out) and of tool tokens, and its weight
digest (sum, sum of squares)."""

import importlib.util
import sys
import tempfile
from contextlib import nullcontext

import torch
import trl_tools
from accelerate.utils import gather_object
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from gppo.integrations.trl import GPPOTrainer, GPPOTrainerConfig
from gppo.models.embedded import build_tokenizer

PROMPTS = ["12+3=", "4*5=", "7-2=", "9+9=", "1+1=", "30/3=", "8-8=", "2*7="]
RUNS = {  # name: (trainer, its config, config fields, with a LoRA adapter, with tools)
    "trl-dapo": (GRPOTrainer, GRPOConfig, {}, False, False),
    "gppo-ppo": (GPPOTrainer, GPPOTrainerConfig, dict(gppo_preset="ppo"), False, False),
    "gppo-dppo-topk-tv": (
        GPPOTrainer,
        GPPOTrainerConfig,
        dict(gppo_preset="dppo-topk-tv", gppo_overrides={"top_k": 5}),
        False,
        False,
    ),
    "trl-dapo-lora": (GRPOTrainer, GRPOConfig, {}, True, False),
    "gppo-ppo-lora": (GPPOTrainer, GPPOTrainerConfig, dict(gppo_preset="ppo"), True, False),
    "gppo-dppo-topk-kl-lora": (GPPOTrainer, GPPOTrainerConfig, dict(gppo_preset="dppo-topk-kl"), True, False),
    "trl-dapo-tools": (GRPOTrainer, GRPOConfig, {}, False, True),
    "gppo-ppo-tools": (GPPOTrainer, GPPOTrainerConfig, dict(gppo_preset="ppo"), False, True),
}


def reward(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")


def run(model_dir: str, trainer_cls, config_cls, fields: dict, lora: bool, tools: bool, output_dir: str) -> dict:
    # 2 processes x 2 micro-batches of 4 completions = 16 completions (4 prompts) per optimizer
    # step; one generation batch of 4 micro-batches per process (all 8 prompts) serves both
    # steps, so the second step's ratios are not 1 and TRL rescales its token count to a window.
    args = config_cls(
        output_dir=output_dir,
        use_cpu=True,
        report_to="none",
        seed=0,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        num_generations=4,
        max_completion_length=96 if tools else 8,
        max_steps=2,
        logging_steps=1,
        learning_rate=5e-2,
        save_strategy="no",
        **fields,
    )
    tool_kwargs = dict(tools=[trl_tools.multiply]) if tools else {}
    trainer = trainer_cls(
        model=model_dir,
        reward_funcs=trl_tools.digits if tools else reward,
        args=args,
        processing_class=trl_tools.chat_tokenizer() if tools else build_tokenizer(),
        train_dataset=Dataset.from_dict({"prompt": trl_tools.prompts(len(PROMPTS)) if tools else PROMPTS}),
        peft_config=lora_config() if lora else None,
        **tool_kwargs,
    )
    with trl_tools.scripted_tool_calls(trainer) if tools else nullcontext():
        trainer.train()
    batches = trainer._buffered_inputs
    tokens = [int((b["completion_mask"] * b.get("tool_mask", 1)).sum()) for b in batches]
    tool_tokens = [int((b["completion_mask"] * (1 - b.get("tool_mask", 1))).sum()) for b in batches]
    model = trainer.accelerator.unwrap_model(trainer.model)
    flat = torch.cat([p.detach().flatten().double() for p in model.parameters()])
    named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    return dict(
        params=[p for n, p in named if "lora_" not in n],  # with an adapter: the base's
        adapter={n: p for n, p in named if "lora_" in n},
        digests=gather_object([(flat.sum().item(), flat.square().sum().item())]),
        logs=trainer.state.log_history,
        tokens=gather_object([tokens]),
        tool_tokens=gather_object([tool_tokens]),
        num_processes=trainer.accelerator.num_processes,
        backend=torch.distributed.get_backend(),
    )


def main(model_dir: str, chat_model_dir: str, result_file: str) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as output_dir:
        for name, (trainer_cls, config_cls, fields, lora, tools) in RUNS.items():
            if lora and importlib.util.find_spec("peft") is None:
                continue
            model = chat_model_dir if tools else model_dir
            results[name] = run(model, trainer_cls, config_cls, fields, lora, tools, output_dir)
    if torch.distributed.get_rank() == 0:
        torch.save(results, result_file)


if __name__ == "__main__":
    main(*sys.argv[1:])
