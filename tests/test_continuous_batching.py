"""Continuous batching: groups join the HF engine's running batch (`HFEngine.stream`) with exact
log-probs, and the asynchronous group stream (gppo.trainer.group_stream) trains each step on the
first groups that finish, drops what is too stale, and checkpoints what it has not trained on."""

import copy
import time

import torch

from gppo.models.loading import load_model_and_tokenizer
from gppo.rollout import Generation, GroupRequest, SamplingParams
from gppo.rollout.hf import HFEngine
from gppo.trainer import Trainer
from gppo.trainer.group_stream import GroupStream, _Group
from tests.test_async_rollouts import LEARNS, metrics_rows, perturbed, record_trained
from tests.test_trainer import micro_config


def full_forward_logp(model, g: Generation, t: int, token: int) -> float:
    ids = torch.tensor([g.prompt_ids + g.completion_ids[:t]])
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits[0, -1].float(), -1)[token].item()


def test_groups_joining_a_running_batch_record_exact_log_probs_and_their_own_draws(micro_model):
    """Groups join at decoding steps 0, 2, 5 and 9 (one prompt longer than the batch's width then, so
    the cache widens; a batch of 6 rows, so it grows and joins wait for free rows), and the weights
    change at step 7: every recorded log mu(a_t) equals a fresh float32 forward under its recorded
    version, and each group draws what it draws when sampled alone with the same row seeds."""
    model, tokenizer = load_model_and_tokenizer(micro_model, torch.float32)
    versions = [copy.deepcopy(model.state_dict()), perturbed(model, 1)]
    engine = HFEngine(model, tokenizer, batch_size=6)
    prompts = ["1+2=", "12+34=", "5+6=", "100+200+300+400+500+600+700=", "7+8="]
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    arrivals = {0: [0, 1], 2: [2], 5: [3], 9: [4]}  # decoding step -> prompts that join
    steps, finished, joined = [], {}, {}

    def policy_version() -> int:
        steps.append(None)
        version = int(len(steps) > 7)
        model.load_state_dict(versions[version])
        return version

    def feed(room: int) -> list[GroupRequest]:
        due = [i for step, ids in arrivals.items() if step <= len(steps) - 1 for i in ids if i not in joined]
        for i in due[:room]:
            joined[i] = len(steps) - 1
        return [GroupRequest(i, encoded[i], (10 * i, 10 * i + 1)) for i in due[:room]]

    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, top_k_logprobs=3, policy_version=policy_version)
    engine.stream(feed, params, lambda key, gens: finished.setdefault(key, gens))
    assert sorted(finished) == [0, 1, 2, 3, 4] and joined[3] >= 5 and joined[4] >= 9
    switched = 0
    for key, gens in finished.items():
        for g in gens:
            switched += len(set(g.versions)) == 2
            for t, (token, version, logp) in enumerate(zip(g.completion_ids, g.versions, g.logprobs)):
                model.load_state_dict(versions[version])
                assert abs(full_forward_logp(model, g, t, token) - logp) < 2e-5, (key, t)
    assert switched >= 2
    model.load_state_dict(versions[0])
    for key in (0, 1):  # sampled alone by generate, from the same seeds and weights (no switch before step 7)
        alone = engine.generate(
            [prompts[key]], SamplingParams(temperature=1.0, max_new_tokens=7, n=2, row_seeds=(10 * key, 10 * key + 1))
        )
        for a, g in zip(alone, finished[key]):
            assert a.completion_ids == g.completion_ids[: len(a.completion_ids)]


class ScriptedEngine:
    """Streams groups whose completions take `length(key)` decoding steps of 2 ms; each completion's
    tokens are its key (so a test can read which groups trained), each version the one loaded."""

    separate_weights, max_top_k_logprobs = False, 0

    def __init__(self, length, vocab: int):
        self.length, self.vocab = length, vocab

    def stream(self, feed, params, done) -> None:
        running = {}  # key -> [prompt ids, steps left, versions]
        while True:
            version = params.policy_version()
            for group in feed(16 - len(running)):
                running[group.key] = [group.prompt_ids, self.length(group.key), []]
            if not running:
                return
            time.sleep(0.002)
            for key in list(running):
                ids, left, seen = running[key]
                seen.append(version)
                running[key][1] = left - 1
                if left == 1:
                    del running[key]
                    token = key % self.vocab
                    done(
                        key,
                        [
                            Generation(key, ids, [token] * len(seen), "x", [-1.0] * len(seen), versions=list(seen))
                            for _ in range(params.n)
                        ],
                    )

    def update_weights(self, model) -> None:
        pass


def test_a_step_trains_on_the_first_groups_that_finish(micro_model, tmp_path):
    """Every fourth group is long (40 decoding steps), the others take 2: step 1 trains on the first
    four short groups (keys 1, 2, 3, 5), not on the first four taken; the long ones train later,
    within the staleness bound, and the metrics count the buffer and the drops."""
    trainer = Trainer(
        micro_config(
            micro_model,
            tmp_path / "run",
            steps=4,
            prompts_per_step=4,
            eval_every=0,
            save_every=0,
            async_rollouts=True,
            max_staleness=2,
            **LEARNS,
        )
    )
    vocab = trainer.model.config.vocab_size
    trainer.generator.engine = ScriptedEngine(lambda key: 40 if key % 4 == 0 else 2, vocab)
    trained = record_trained(trainer)
    trainer.train()
    keys = [sorted({int(row[r.response_mask[i].bool()][0]) for i, row in enumerate(r.token_ids)}) for _, r in trained]
    assert keys[0] == [1, 2, 3, 5]
    assert any(0 in k for k in keys[1:])
    for step, rollout in trained:
        assert step - int(rollout.versions[rollout.response_mask.bool()].min()) <= 2
    rows = [r for r in metrics_rows(tmp_path / "run") if "staleness/buffer_depth" in r]
    assert len(rows) == 4 and all(
        r["staleness/buffer_depth"] >= 0 and r["staleness/dropped_samples"] >= 0 for r in rows
    )


def test_groups_too_stale_when_taken_are_dropped_and_counted(micro_model, tmp_path):
    """Out-of-order finishing can hand a step a group older than the bound: it is dropped (its slot
    freed) and its completions counted, and the step waits for fresh ones."""
    trainer = Trainer(
        micro_config(micro_model, tmp_path / "run", steps=2, prompts_per_step=2, async_rollouts=True, max_staleness=1)
    )
    stream: GroupStream = trainer.async_rollouts
    gens = [Generation(0, [1], [2, 3], "x", [-1.0, -1.0], versions=[v, v]) for v in (3, 4, 5)]
    for key, g in enumerate(gens):
        stream._source_at[key] = {}
        stream._ready.append(_Group(key, None, [g, g], torch.zeros(2), [0.0, 0.0], 0))
    with stream.gate.changed:  # what `take` holds while it asks
        assert stream._enough(5)  # the version-3 group is 2 behind step 5: dropped; two fresh ones left
        assert [g.key for g in stream._ready] == [1, 2] and stream._dropped == 2
        assert not stream._enough(6)  # and at step 6 the version-4 group goes too
        assert [g.key for g in stream._ready] == [2] and stream._dropped == 4
    assert stream.checkpoint_state(6)["stream"] == {"next_key": 2, "skip": []}
    trainer.close()


def test_a_checkpoint_holds_the_groups_not_trained_on_and_a_resumed_run_samples_them_again(micro_model, tmp_path):
    """With the long groups of the scripted engine, the checkpoint after step 1 starts at the lowest
    key not trained on and skips the keys above it already trained on: the resumed run samples the
    groups under way then (0 and 4) again, passes over those trained on, and goes on."""
    changes = dict(steps=3, prompts_per_step=4, eval_every=0, async_rollouts=True, max_staleness=2, **LEARNS)
    part = Trainer(micro_config(micro_model, tmp_path / "run", **changes))
    vocab = part.model.config.vocab_size
    part.generator.engine = ScriptedEngine(lambda key: 40 if key % 4 == 0 else 2, vocab)
    first = record_trained(part)
    part.train(stop_after=1)
    state = torch.load(
        sorted((tmp_path / "run" / "checkpoints").iterdir())[-1] / "trainer_state.pt", weights_only=False
    )
    assert state["stream"]["next_key"] == 0 and state["stream"]["skip"] == [1, 2, 3, 5]
    resumed = Trainer.resume(tmp_path / "run")
    resumed.generator.engine = ScriptedEngine(lambda key: 2, vocab)  # now every group ends in key order
    later = record_trained(resumed)
    resumed.train()

    def keys(rollout):
        return {int(row[rollout.response_mask[i].bool()][0]) for i, row in enumerate(rollout.token_ids)}

    before, after = keys(first[0][1]), set().union(*(keys(r) for _, r in later))
    assert before == {1, 2, 3, 5} and after == {0, 4, 6, 7, 8, 9, 10, 11}
