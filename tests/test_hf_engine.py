import dataclasses
import math
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from gppo.models.embedded import build_model, build_tokenizer
from gppo.rollout.base import SamplingParams
from gppo.rollout.hf import HFEngine, inverse_cdf_sample, top_p_truncate

torch.set_num_threads(1)

PROMPTS = ["1+2=", "123+456=", "2 3 7 -> 27:", "9"]


@pytest.fixture(scope="module")
def micro():
    tok = build_tokenizer()
    return build_model(tok, seed=0, hidden=32, layers=1).eval(), tok


def test_inverse_cdf_sampler_draws_each_token_with_its_probability():
    """200k draws from 4 rows of a 1000-token distribution (one row a top-p nucleus, most of its
    vocabulary at probability 0): every token's count within 5 binomial standard deviations of
    draws x p, and no zero-probability token ever drawn."""
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(3 * torch.randn(4, 1000, generator=gen), -1)
    logp[3], _ = top_p_truncate(logp[3:], 0.5)
    probs = logp.exp()
    draws = 200_000
    counts = torch.zeros_like(probs, dtype=torch.float64)
    for _ in range(draws // 10_000):
        tokens = inverse_cdf_sample(probs.repeat_interleave(10_000, 0), gen).view(4, 10_000)
        counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.float64))
    expected = draws * probs.double()
    assert (counts[probs == 0] == 0).all()
    assert ((counts - expected).abs() <= 5 * (expected * (1 - probs.double())).sqrt() + 1).all()


def full_pass_logprobs(model, gen, temperature):
    """log_softmax(logits / T) of one unpadded forward pass over prompt + completion."""
    ids = torch.tensor([gen.prompt_ids + gen.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(gen.prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_logprobs_and_topk_match_a_full_forward_pass(micro, temperature):
    model, tok = micro
    engine = HFEngine(model, tok, batch_size=5)  # 8 sequences: two chunks, mixed prompt lengths
    gens = engine.generate(
        PROMPTS, SamplingParams(temperature=temperature, max_new_tokens=10, n=2, top_k_logprobs=4, seed=0)
    )
    assert [g.prompt_index for g in gens] == [0, 0, 1, 1, 2, 2, 3, 3]
    for g in gens:
        assert g.prompt_ids == tok(PROMPTS[g.prompt_index])["input_ids"]
        ref = full_pass_logprobs(model, g, temperature)
        ids = torch.tensor(g.completion_ids)
        torch.testing.assert_close(
            torch.tensor(g.logprobs), ref.gather(-1, ids[:, None]).squeeze(-1), atol=1e-5, rtol=0
        )
        top_lp, top_ids = ref.topk(4, dim=-1)
        assert torch.equal(torch.tensor(g.topk_ids), top_ids)
        torch.testing.assert_close(torch.tensor(g.topk_logprobs), top_lp, atol=1e-5, rtol=0)
        if temperature == 0:
            assert torch.equal(ids, ref.argmax(-1))


def test_eos_stops_each_sequence_and_padding_does_not_leak(micro):
    model, tok = micro
    engine = HFEngine(model, tok, batch_size=64)
    # A model that likes EOS: boost its logit so sequences stop at different steps.
    weight = model.get_output_embeddings().weight
    saved = weight[tok.eos_token_id].detach().clone()
    with torch.no_grad():
        weight[tok.eos_token_id] *= 3
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=8, n=16, seed=1)
        gens = engine.generate(PROMPTS, params)
        reasons = {g.finish_reason for g in gens}
        assert reasons == {"stop", "length"}
        for g in gens:
            eos_at = [i for i, t in enumerate(g.completion_ids) if t == tok.eos_token_id]
            if g.finish_reason == "stop":
                assert eos_at == [len(g.completion_ids) - 1]
            else:
                assert eos_at == [] and len(g.completion_ids) == params.max_new_tokens
            assert len(g.logprobs) == len(g.completion_ids)
            assert g.text == tok.decode(g.completion_ids, skip_special_tokens=True)
            assert "<eos>" not in g.text
            ref = full_pass_logprobs(model, g, 1.0)
            torch.testing.assert_close(
                torch.tensor(g.logprobs),
                ref.gather(-1, torch.tensor(g.completion_ids)[:, None]).squeeze(-1),
                atol=1e-5,
                rtol=0,
            )
        # Greedy: a prompt gives the same completion alone as inside a left-padded batch.
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
        batched = engine.generate(PROMPTS, greedy)
        for p, g in zip(PROMPTS, batched):
            assert engine.generate([p], greedy)[0].completion_ids == g.completion_ids
    finally:
        with torch.no_grad():
            weight[tok.eos_token_id] = saved


def test_max_new_tokens_gives_length(micro):
    model, tok = micro
    gens = HFEngine(model, tok).generate(["1+2="], SamplingParams(max_new_tokens=1, n=4, seed=0))
    for g in gens:
        assert len(g.completion_ids) == 1
        assert g.finish_reason == ("stop" if g.completion_ids[0] == tok.eos_token_id else "length")


def test_seeded_reproducibility(micro):
    model, tok = micro
    engine = HFEngine(model, tok, batch_size=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=123)
    a, b = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert [g.completion_ids for g in a] == [g.completion_ids for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]
    c = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=124))
    assert [g.completion_ids for g in a] != [g.completion_ids for g in c]


def test_row_seeds_give_each_completion_a_random_stream_of_its_own(micro):
    """With `row_seeds`, completion j draws from a generator seeded row_seeds[j] alone: it samples
    the same tokens (with the same log-probs) whatever the batch around it (other prompts, other
    rows, another batch split), and two completions of one prompt with different seeds differ."""
    model, tok = micro
    seeds = tuple(range(100, 108))
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, row_seeds=seeds)
    batch = HFEngine(model, tok, batch_size=3).generate(PROMPTS, params)
    for j in (0, 5, 7):
        (alone,) = HFEngine(model, tok).generate(
            [PROMPTS[j // 2]], dataclasses.replace(params, n=1, row_seeds=(seeds[j],))
        )
        assert alone.completion_ids == batch[j].completion_ids
        torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(batch[j].logprobs), atol=1e-5, rtol=0)
    for a, b in zip(batch[::2], batch[1::2]):
        assert a.completion_ids != b.completion_ids
    swapped = HFEngine(model, tok).generate(PROMPTS[:1], dataclasses.replace(params, row_seeds=seeds[1::-1]))
    assert [g.completion_ids for g in swapped] == [g.completion_ids for g in batch[1::-1]]
    with pytest.raises(ValueError, match="row_seeds has 1 seeds for 8 completions"):
        HFEngine(model, tok).generate(PROMPTS, dataclasses.replace(params, row_seeds=(1,)))


def test_top_p_truncates_the_recorded_distribution(micro):
    model, tok = micro
    gens = HFEngine(model, tok).generate(
        PROMPTS, SamplingParams(top_p=0.5, max_new_tokens=6, seed=0, top_k_logprobs=len(tok))
    )
    for g in gens:
        for step_lps in g.topk_logprobs:
            kept = torch.tensor(step_lps).exp()
            assert abs(kept.sum().item() - 1) < 1e-5  # renormalised over the kept tokens
            assert (kept == 0).sum() > 0  # some tokens truncated
            assert kept[0] > 0


def test_engine_api_and_errors(micro):
    model, tok = micro
    engine = HFEngine(model, tok)
    assert engine.max_top_k_logprobs == len(tok)
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        engine.generate(["1"], SamplingParams(top_k_logprobs=len(tok) + 1))
    with pytest.raises(ValueError, match="temperature >= 0"):
        engine.generate(["1"], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="empty after tokenization"):
        engine.generate([""], SamplingParams())
    no_eos = build_tokenizer()
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="no EOS token"):
        HFEngine(model, no_eos)


def test_other_architecture_with_absolute_positions():
    """GPT-2 adds learned absolute position embeddings: wrong position_ids under left padding
    would change its log-probs."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = build_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tok),
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=64,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    model = GPT2LMHeadModel(config).eval()
    gens = HFEngine(model, tok).generate(PROMPTS, SamplingParams(max_new_tokens=8, n=2, seed=0))
    for g in gens:
        ref = full_pass_logprobs(model, g, 1.0)
        torch.testing.assert_close(
            torch.tensor(g.logprobs),
            ref.gather(-1, torch.tensor(g.completion_ids)[:, None]).squeeze(-1),
            atol=1e-5,
            rtol=0,
        )


def test_every_eos_id_of_the_generation_config_stops(micro):
    model, tok = micro
    nine = tok.convert_tokens_to_ids("9")
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, nine]
    weight = model.get_output_embeddings().weight
    saved_row = weight[nine].detach().clone()
    with torch.no_grad():
        weight[nine] *= 3  # make "9" frequent
    try:
        gens = HFEngine(model, tok).generate(PROMPTS, SamplingParams(max_new_tokens=12, n=8, seed=0))
        stopped_at_nine = 0
        for g in gens:
            stops = [i for i, t in enumerate(g.completion_ids) if t in (tok.eos_token_id, nine)]
            assert stops == ([len(g.completion_ids) - 1] if g.finish_reason == "stop" else [])
            stopped_at_nine += g.finish_reason == "stop" and g.completion_ids[-1] == nine
        assert stopped_at_nine > 0
    finally:
        model.generation_config.eos_token_id = saved
        with torch.no_grad():
            weight[nine] = saved_row


def nucleus64(logits, temperature, top_p):
    """float64 brute force: the ids of the top-p nucleus (mass strictly before a token < top_p)
    and log mu_S on the whole vocabulary (-inf outside S)."""
    p = torch.softmax(logits.double() / temperature, -1)
    if top_p >= 1:
        return [list(range(p.shape[-1]))] * len(p), p.log()
    kept = []
    for row in p:
        order = row.argsort(descending=True).tolist()
        mass, ids = 0.0, []
        for a in order:
            if mass >= top_p:
                break
            ids.append(a)
            mass += row[a].item()
        kept.append(ids)
    mask = torch.zeros_like(p, dtype=torch.bool)
    for t, ids in enumerate(kept):
        mask[t, ids] = True
    return kept, torch.log(torch.where(mask, p, 0.0) / torch.where(mask, p, 0.0).sum(-1, keepdim=True))


def test_top_p_records_the_nucleus_and_its_renormalised_log_probs(micro):
    model, tok = micro
    V = len(tok)
    gens = HFEngine(model, tok, batch_size=5).generate(
        PROMPTS,
        SamplingParams(
            temperature=0.8, top_p=0.6, max_new_tokens=6, n=2, seed=0, top_k_logprobs=V, record_kept_ids=True
        ),
    )
    for g in gens:
        ids = torch.tensor([g.prompt_ids + g.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(g.prompt_ids) - 1 : -1]
        kept, log_mu_s = nucleus64(logits, 0.8, 0.6)
        assert [sorted(s) for s in g.kept_ids] == [sorted(s) for s in kept]
        assert all(1 <= len(s) < V for s in kept)
        assert all(a in s for a, s in zip(g.completion_ids, g.kept_ids))
        ref = log_mu_s.gather(-1, torch.tensor(g.completion_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(g.logprobs, dtype=torch.float64), ref, atol=1e-5, rtol=0)
        for s, top_ids, top_lps in zip(g.kept_ids, g.topk_ids, g.topk_logprobs):
            finite = {a for a, lp in zip(top_ids, top_lps) if lp > float("-inf")}
            assert finite == set(s)  # mu_S is 0 outside the nucleus
    plain = HFEngine(model, tok).generate(PROMPTS, SamplingParams(top_p=0.6, max_new_tokens=3, seed=0))
    assert all(g.kept_ids is None for g in plain)  # recorded only on request


def test_top_p_training_forward_gives_ratio_one_and_exact_divergences(micro):
    """Scored on the recorded nucleus, pi = mu gives r = 1 at every token (scored on the full
    vocabulary it would give r = mu(S) < 1); for another pi the full estimator is the float64
    D_TV(pi_S || mu_S), and top-K equals it wherever |S| <= K."""
    import gppo
    from gppo.models.embedded import build_model
    from gppo.models.forward import policy_outputs
    from gppo.trainer.batch import rollout_from_generations, token_batch

    model, tok = micro
    K = 40  # of 55 tokens: the near-uniform micro model's nucleus of mass 0.6 holds about 30
    gens = HFEngine(model, tok).generate(
        PROMPTS,
        SamplingParams(
            temperature=0.8, top_p=0.6, max_new_tokens=6, n=2, seed=1, top_k_logprobs=K, record_kept_ids=True
        ),
    )
    rollout = rollout_from_generations(gens, torch.linspace(-1, 1, len(gens)), tok.pad_token_id, top_k=K)
    valid = rollout.response_mask.bool()
    with torch.no_grad():
        out = policy_outputs(model, rollout, 0.8, return_log_probs=True)
        untruncated = policy_outputs(
            model, dataclasses.replace(rollout, kept_sizes=None, kept_ids=None), 0.8, return_log_probs=True
        )
    torch.testing.assert_close(out.logp[valid], rollout.logp_behavior[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.topk_logp.exp()[valid], rollout.topk_logp_behavior.exp()[valid], atol=1e-5, rtol=0)
    ratio_full_vocab = (untruncated.logp - rollout.logp_behavior).exp()[valid]
    assert (ratio_full_vocab < 1 - 1e-3).any() and (ratio_full_vocab <= 1 + 1e-5).all()

    rollout.logp_behavior_full = out.log_probs
    other = build_model(tok, seed=5, hidden=32, layers=1).eval()
    with torch.no_grad():
        pi = policy_outputs(other, rollout, 0.8, gppo.preset("dppo-topk-tv", estimator="full"))
    batch = token_batch(rollout, pi)
    assert torch.isfinite(gppo.policy_loss(batch, gppo.preset("dppo-topk-tv", top_k=K))[0])
    full = gppo.estimate(gppo.preset("dppo-topk-tv", estimator="full"), batch)
    topk = gppo.estimate(gppo.preset("dppo-topk-tv", top_k=K), batch)
    with torch.no_grad():  # reference: full-vocabulary float64 softmax, masked to S by hand, renormalised
        full_pi = policy_outputs(
            other, dataclasses.replace(rollout, kept_sizes=None, kept_ids=None), 0.8, return_log_probs=True
        )
    in_s = torch.zeros_like(valid[..., None].expand(-1, -1, len(tok)))
    for row, g in enumerate(gens):
        for t, ids in enumerate(g.kept_ids):
            in_s[row, t, ids] = True
    pi_s, mu_s = (torch.where(in_s, x.log_probs.double().exp(), 0.0) for x in (full_pi, untruncated))
    pi_s, mu_s = pi_s / pi_s.sum(-1, keepdim=True), mu_s / mu_s.sum(-1, keepdim=True)
    tv = 0.5 * (pi_s - mu_s).abs().sum(-1)
    torch.testing.assert_close(full.double()[valid], tv[valid], atol=1e-5, rtol=0)
    small = valid & (rollout.kept_sizes <= K)
    assert small.any() and (tv[small] > 1e-3).any()
    torch.testing.assert_close(topk[small], full[small], atol=1e-5, rtol=0)


def test_trainer_top_p_step_and_bad_value(micro_model, tmp_path):
    """A trainer step with rollout_top_p < 1 records the nucleus and gives finite metrics (the
    entropy of the truncated policy included); an out-of-range value is refused by name."""
    from gppo.trainer import ConfigError, Trainer
    from tests.test_trainer import micro_config

    with pytest.raises(ConfigError, match=r"rollout_top_p must be <= 1 \(got 1.5\)"):
        Trainer(micro_config(micro_model, tmp_path / "bad", rollout_top_p=1.5))
    trainer = Trainer(micro_config(micro_model, tmp_path / "run", rollout_top_p=0.6, preset="dppo-topk-tv", top_k=40))
    rollout, _ = trainer.rollout()
    assert rollout.kept_sizes is not None and (rollout.kept_sizes[rollout.response_mask.bool()] < 55).all()
    metrics = trainer.train_step()
    assert all(math.isfinite(metrics[k]) for k in ("loss/entropy", "loss/masked_frac", "optim/grad_norm"))
