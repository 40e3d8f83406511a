"""token_stats: every output and its gradients (hidden, weight, bias) against the plain unchunked
autograd computation written here, gppo's own full estimator and reference KL, closed forms; what
autograd saves; bad inputs."""

import importlib
import math
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F

import gppo
from gppo.core.loss import reference_kl
from gppo.core.token_stats import token_stats
from gppo.core.vocab import log_normalize_

module = importlib.import_module("gppo.core.token_stats")  # gppo.core.token_stats is also the function

DIFFERENTIABLE = ("logp", "topk_logp", "entropy", "kl_ref_full")
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-10, atol=1e-10)}


@dataclass
class Case:
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    token_ids: torch.Tensor
    topk_ids: torch.Tensor
    ref: torch.Tensor  # [n, V] the reference's log-distribution
    anchor: torch.Tensor  # [n, V] the anchor's log-distribution
    kept_sizes: torch.Tensor | None = None
    kept_ids: torch.Tensor | None = None
    kept: torch.Tensor | None = None  # [n, V] bool, built row by row

    def params(self):
        return [x for x in (self.hidden, self.weight, self.bias) if x is not None]


def make_case(n=10, width=16, vocab=300, k=4, dtype=torch.float64, bias=True, nucleus=False, seed=0):
    """Random inputs; with a nucleus, row 1 keeps one id, row 2 the whole vocabulary and the last
    row none (padding). topk_ids hold the sampled id and a duplicate pair."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return (0.5 * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    hidden, weight = randn(n, width).requires_grad_(), randn(vocab, width).requires_grad_()
    bias_ = randn(vocab).requires_grad_() if bias else None
    token_ids = torch.randint(0, vocab, (n,), generator=gen)
    kept_sizes = kept_ids = kept = None
    if nucleus:
        kept_sizes = torch.randint(2, min(vocab, 40), (n,), generator=gen)
        kept_sizes[1], kept_sizes[2], kept_sizes[-1] = 1, vocab, 0
        kept = torch.zeros(n, vocab, dtype=torch.bool)
        rows = []
        for i, size in enumerate(kept_sizes.tolist()):
            ids = torch.randperm(vocab, generator=gen)[:size]
            rows.append(ids)
            kept[i, ids] = True
            if size:
                token_ids[i] = ids[0]
        kept_ids = torch.cat(rows)
    topk_ids = torch.randint(0, vocab, (n, k), generator=gen)
    topk_ids[:, 0], topk_ids[:, 2] = token_ids, topk_ids[:, 1]

    def distribution():
        logits = 2 * torch.randn(n, vocab, generator=gen, dtype=torch.float64)
        if kept is not None:
            logits = logits.masked_fill(~kept, torch.finfo(torch.float64).min)
        return torch.log_softmax(logits, -1).to(dtype)

    return Case(hidden, weight, bias_, token_ids, topk_ids, distribution(), distribution(), kept_sizes, kept_ids, kept)


def work(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference(case: Case, temperature: float):
    """The plain computation: all logits at once, cast, / T, masked, log_softmax; autograd."""
    dtype = work(case.weight.dtype)
    z = F.linear(case.hidden, case.weight, case.bias).to(dtype) / temperature
    if case.kept is not None:
        z = z.masked_fill(~case.kept, torch.finfo(dtype).min)
    log_pi = torch.log_softmax(z, -1)
    pi = log_pi.exp()

    def where_pi(x):  # 0 where pi = 0 (0 * log 0 = 0), in value and gradient
        return torch.where(pi > 0, x, 0.0)

    return dict(
        logits=z,
        log_probs=log_pi,
        logp=log_pi.gather(1, case.token_ids[:, None])[:, 0],
        topk_logp=log_pi.gather(1, case.topk_ids),
        entropy=-(pi * where_pi(log_pi)).sum(-1),
        kl_ref_full=(pi * where_pi(log_pi - case.ref.to(dtype))).sum(-1),
    )


def run(case: Case, temperature=1.0, chunk_size=None, outputs=DIFFERENTIABLE, divergence="kl", log_probs=False):
    return token_stats(
        case.hidden,
        case.weight,
        case.token_ids,
        bias=case.bias,
        temperature=temperature,
        topk_ids=case.topk_ids if "topk_logp" in outputs else None,
        kept_sizes=case.kept_sizes,
        kept_ids=case.kept_ids,
        entropy="entropy" in outputs,
        ref_log_probs=case.ref if "kl_ref_full" in outputs else None,
        anchor_log_probs=case.anchor if "full_estimate" in outputs else None,
        divergence=gppo.divergence(divergence) if "full_estimate" in outputs else None,
        return_log_probs=log_probs,
        chunk_size=chunk_size,
    )


def gradients(case: Case, values: dict, outputs, seed=1):
    """Gradients of sum_o <u_o, value_o> for fixed random u_o, wrt hidden, weight and bias."""
    gen = torch.Generator().manual_seed(seed)
    loss = sum(
        (values[o] * torch.randn(values[o].shape, generator=gen, dtype=torch.float64).to(values[o].dtype)).sum()
        for o in outputs
    )
    return torch.autograd.grad(loss, case.params())


def check(case, temperature, chunk_size, outputs, tol):
    got = run(case, temperature, chunk_size, outputs)
    want = reference(case, temperature)
    for name in outputs:
        torch.testing.assert_close(getattr(got, name), want[name], **tol, msg=name)
    for name in set(DIFFERENTIABLE) - set(outputs) - {"logp"}:  # logp is always computed
        assert getattr(got, name) is None
    for mine, theirs in zip(gradients(case, vars(got), outputs), gradients(case, want, outputs)):
        torch.testing.assert_close(mine, theirs, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("nucleus", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 3, 5, 10, 17, None])
def test_all_outputs_match_the_unchunked_reference(dtype, bias, temperature, nucleus, chunk_size):
    case = make_case(dtype=dtype, bias=bias, nucleus=nucleus, vocab=50 if chunk_size == 3 else 300)
    check(case, temperature, chunk_size, DIFFERENTIABLE, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("output", DIFFERENTIABLE)
def test_each_output_alone(dtype, output):
    case = make_case(n=9, vocab=5000, dtype=dtype, nucleus=True, seed=2)
    check(case, 0.7, 4, (output,), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pairs_of_outputs(dtype):
    case = make_case(dtype=dtype, nucleus=True, seed=3)
    for pair in (("logp", "entropy"), ("topk_logp", "kl_ref_full"), ("entropy", "kl_ref_full")):
        check(case, 1.0, 3, pair, TOL[dtype])


def test_zero_temperature_means_one():
    case = make_case(dtype=torch.float32)
    for temperature in (0.0, -1.0):
        assert torch.equal(run(case, temperature).logp, run(case, 1.0).logp)


def test_bfloat16_model_matches_the_same_logits_upcast():
    """bf16 hidden and weight: the matmul in bf16, as the model's output layer does, then float32;
    gradients at bf16 precision (they pass through the bf16 matmul in both)."""
    case = make_case(n=12, width=32, vocab=1000, dtype=torch.bfloat16, nucleus=True, seed=4)
    got, want = run(case, 0.7, 5), reference(case, 0.7)
    assert want["logits"].dtype == torch.float32 and got.logp.dtype == torch.float32
    for name in DIFFERENTIABLE:
        torch.testing.assert_close(getattr(got, name), want[name], **TOL[torch.float32], msg=name)
    for mine, theirs in zip(gradients(case, vars(got), DIFFERENTIABLE), gradients(case, want, DIFFERENTIABLE)):
        assert mine.dtype == torch.bfloat16
        scale = theirs.float().abs().max()
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=2e-2, atol=1e-2 * scale)


def test_hidden_is_cast_to_the_weight_dtype():
    case = make_case(dtype=torch.bfloat16, seed=5)
    wide = case.hidden.detach().float().requires_grad_()
    got = token_stats(wide, case.weight, case.token_ids, bias=case.bias, entropy=True)
    same = token_stats(case.hidden, case.weight, case.token_ids, bias=case.bias, entropy=True)
    torch.testing.assert_close(got.entropy, same.entropy, rtol=0, atol=0)
    (got.logp.sum() + got.entropy.sum()).backward()
    assert wide.grad.dtype == torch.float32 and case.weight.grad.dtype == torch.bfloat16


def test_autocast_does_not_change_the_dtype_of_the_logits():
    """Forward and backward both compute the logits in the weight's dtype, inside autocast too."""
    case = make_case(dtype=torch.float32, seed=15)
    plain = run(case, 0.7, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = run(case, 0.7, 3)
    for name in DIFFERENTIABLE:
        assert torch.equal(getattr(cast, name), getattr(plain, name))
    for a, b in zip(gradients(case, vars(cast), DIFFERENTIABLE), gradients(case, vars(plain), DIFFERENTIABLE)):
        assert torch.equal(a, b)


def test_float32_accuracy_at_a_50k_vocabulary():
    """The log-softmax against float64 of the same float32 logits (|log pi| reaches 19 here, where
    a float32 ulp is 2e-6): within a few ulp per entry, the normaliser (the row's mean error)
    within 1e-6, as log_normalize_ (which the `full` estimator uses); gradients against float64
    autograd."""
    case = make_case(n=4, width=16, vocab=50_000, dtype=torch.float32, seed=6)
    got = run(case, 0.7, 3, log_probs=True)
    logits = reference(case, 0.7)["logits"].detach()
    exact = torch.log_softmax(logits.double(), -1)
    for log_pi in (got.log_probs, log_normalize_(logits.clone())):
        error = log_pi.double() - exact
        assert error.abs().max() < 5e-6 and error.mean(-1).abs().max() < 1e-6
    torch.testing.assert_close(got.log_probs, log_normalize_(logits.clone()), rtol=4e-7, atol=1e-6)
    assert (got.logp.double() - exact.gather(1, case.token_ids[:, None])[:, 0]).abs().max() < 5e-6
    entropy = -(exact.exp() * exact).sum(-1)
    assert (got.entropy.double() - entropy).abs().max() < 2e-5 * entropy.abs().max()

    wide = make_case(n=4, width=16, vocab=50_000, dtype=torch.float64, seed=6)
    wide.hidden, wide.weight, wide.bias = (x.detach().double().requires_grad_() for x in case.params())
    want = reference(wide, 0.7)
    for mine, theirs in zip(gradients(case, vars(got), DIFFERENTIABLE), gradients(wide, want, DIFFERENTIABLE)):
        torch.testing.assert_close(mine.double(), theirs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["kl", "tv", "rkl", "chi2", "hellinger", "js"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_estimate_matches_the_full_estimator(name, dtype):
    case = make_case(n=11, vocab=400, dtype=dtype, nucleus=True, seed=7)
    anchor = case.anchor.clone()
    got = run(case, 0.7, 4, outputs=("logp", "full_estimate"), divergence=name).full_estimate
    assert not got.requires_grad and torch.equal(case.anchor, anchor)  # the input is left as it was
    logits = reference(case, 0.7)["logits"].detach().double()
    # the float64 sum of the cell terms mu f(pi / mu) (Divergence.between_log), not the closed forms
    want = gppo.divergence(name).between_log(torch.log_softmax(logits, -1), torch.log_softmax(case.anchor.double(), -1))
    # chi2 reaches ~30 on these logits: float32 sums in another order differ by a few ulps of it
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (1e-10, 1e-12)
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_estimate_closed_forms_for_kl_and_tv(dtype):
    """KL(mu || pi) = sum mu (log mu - log pi) and TV = (1/2) sum |pi - mu|, in float64."""
    case = make_case(n=11, vocab=400, dtype=dtype, nucleus=True, seed=8)
    log_pi = torch.log_softmax(reference(case, 0.7)["logits"].detach().double(), -1)
    log_mu = torch.log_softmax(case.anchor.double(), -1)
    pi, mu = log_pi.exp(), log_mu.exp()
    closed = {"kl": torch.where(mu > 0, mu * (log_mu - log_pi), 0.0).sum(-1), "tv": 0.5 * (pi - mu).abs().sum(-1)}
    for name, want in closed.items():
        got = run(case, 0.7, 3, outputs=("logp", "full_estimate"), divergence=name).full_estimate
        assert got.dtype == work(dtype)
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_kl_ref_full_matches_gppo_reference_kl():
    """The value and gradient of gppo.reference_kl(kl_estimator='full') on the full logits."""
    case = make_case(n=8, vocab=300, dtype=torch.float64, nucleus=True, seed=9)
    got = run(case, 0.7, 3, outputs=("kl_ref_full",)).kl_ref_full
    logits = reference(case, 0.7)["logits"]
    n = logits.shape[0]
    batch = gppo.TokenBatch(
        logp=torch.zeros(1, n),
        logp_behavior=torch.zeros(1, n),
        advantages=torch.ones(1),
        mask=torch.ones(1, n),
        logits=logits[None],
        logp_ref_full=case.ref[None],
    )
    want = reference_kl(batch, "full")[0]
    torch.testing.assert_close(got, want, **TOL[torch.float64])
    for mine, theirs in zip(gradients(case, {"kl": got}, ("kl",)), gradients(case, {"kl": want}, ("kl",))):
        torch.testing.assert_close(mine, theirs, **TOL[torch.float64])


def test_log_probs_are_the_full_distribution_without_gradient():
    case = make_case(n=7, vocab=200, dtype=torch.float32, nucleus=True, seed=10)
    got = run(case, 0.7, 2, outputs=("logp",), log_probs=True).log_probs
    assert got.shape == (7, 200) and got.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got, reference(case, 0.7)["log_probs"].detach(), **TOL[torch.float32])
    assert run(case, 0.7, 2, outputs=("logp",)).log_probs is None


def test_only_the_parameters_that_require_grad_get_one():
    case = make_case(dtype=torch.float64, seed=11)
    case.weight.requires_grad_(False)
    stats = run(case, 1.0, 3)
    (stats.logp.sum() + stats.entropy.sum()).backward()
    assert case.weight.grad is None and case.hidden.grad is not None and case.bias.grad is not None
    frozen = make_case(dtype=torch.float64, seed=11)
    for x in frozen.params():
        x.requires_grad_(False)
    assert run(frozen, 1.0, 3).logp.grad_fn is None


def test_no_tokens():
    """A micro-batch without tokens: empty outputs, zero parameter gradients."""
    case = make_case(n=0, dtype=torch.float32)
    case.kept_sizes, case.kept_ids = (torch.zeros(0, dtype=torch.long) for _ in range(2))
    stats = run(case, 0.7, 3, outputs=(*DIFFERENTIABLE, "full_estimate"), log_probs=True)
    assert stats.logp.shape == (0,) and stats.topk_logp.shape == (0, 4) and stats.log_probs.shape == (0, 300)
    (stats.logp.sum() + stats.entropy.sum() + stats.kl_ref_full.sum()).backward()
    assert case.hidden.grad.shape == (0, 16) and not case.weight.grad.any() and not case.bias.grad.any()


def test_default_chunk_rows(monkeypatch):
    assert module._chunk_rows(None, 151_936) == (1 << 24) // 151_936
    assert module._chunk_rows(None, 1 << 25) == 1
    monkeypatch.setattr(module, "CHUNK_ELEMENTS", 2 * 300)  # 2 rows per chunk of V = 300
    check(make_case(dtype=torch.float64, nucleus=True, seed=12), 0.7, None, DIFFERENTIABLE, TOL[torch.float64])


def saved_shapes(fn):
    """The tensors autograd saves while `fn` runs: (shape, data_ptr) each."""
    saved = []

    def pack(x):
        saved.append((tuple(x.shape), x.data_ptr()))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return saved


@pytest.mark.parametrize("nucleus", [False, True])
def test_autograd_saves_no_n_by_v_tensor(nucleus):
    """Beyond the inputs, autograd keeps per-row values only; with a reference the [n, V]
    ref_log_probs it keeps is the caller's tensor itself, not a copy."""
    n, vocab, k = 24, 500, 4
    case = make_case(n=n, width=16, vocab=vocab, k=k, dtype=torch.float32, nucleus=nucleus, seed=13)
    outputs = ("logp", "topk_logp", "entropy", "full_estimate")
    saved = saved_shapes(lambda: run(case, 0.7, 5, outputs, log_probs=True))
    inputs = {
        x.data_ptr()
        for x in (case.hidden, case.weight, case.bias, case.token_ids, case.topk_ids, case.kept_sizes, case.kept_ids)
        if x is not None
    }
    assert saved and all(math.prod(shape) < n * vocab for shape, _ in saved)
    assert all(shape == (n,) for shape, ptr in saved if ptr not in inputs)  # per-row values

    saved = saved_shapes(lambda: run(case, 0.7, 5, (*outputs, "kl_ref_full")))
    large = [ptr for shape, ptr in saved if math.prod(shape) >= n * vocab]
    assert large == [case.ref.data_ptr()]


def bad(**changes):
    case = make_case(n=6, vocab=50, dtype=torch.float32, nucleus=True, seed=14)
    kwargs = dict(
        bias=case.bias,
        topk_ids=case.topk_ids,
        kept_sizes=case.kept_sizes,
        kept_ids=case.kept_ids,
        ref_log_probs=case.ref,
        entropy=True,
    )
    args = dict(hidden=case.hidden, weight=case.weight, token_ids=case.token_ids)
    for name, value in changes.items():
        (args if name in args else kwargs)[name] = value(case) if callable(value) else value
    return lambda: token_stats(args["hidden"], args["weight"], args["token_ids"], **kwargs)


BAD_INPUTS = {
    "hidden 1-D": (bad(hidden=torch.zeros(16)), r"hidden must have 2 dimension\(s\), got shape \[16\]"),
    "hidden width": (
        bad(hidden=torch.zeros(6, 8)),
        r"hidden must be \[n, H\] with H = weight.shape\[1\] = 16, got \[6, 8\]",
    ),
    "weight ints": (bad(weight=torch.zeros(50, 16, dtype=torch.long)), r"weight must be a floating-point tensor"),
    "token_ids float": (bad(token_ids=torch.zeros(6)), r"token_ids must be a long integer tensor, got torch.float32"),
    "token_ids int32": (bad(token_ids=torch.zeros(6, dtype=torch.int32)), r"token_ids must be a long integer"),
    "token_ids rows": (bad(token_ids=torch.zeros(5, dtype=torch.long)), r"token_ids must be \[6\] .*got \[5\]"),
    "token_ids 2-D": (bad(token_ids=torch.zeros(6, 1, dtype=torch.long)), r"token_ids must have 1 dimension"),
    "token_ids range": (
        bad(token_ids=torch.full((6,), 50)),
        r"token_ids must lie in \[0, V = 50\), got values in \[50, 50\]",
    ),
    "topk_ids 1-D": (bad(topk_ids=torch.zeros(6, dtype=torch.long)), r"topk_ids must have 2 dimension"),
    "topk_ids rows": (bad(topk_ids=torch.zeros(5, 3, dtype=torch.long)), r"topk_ids must be \[6, K\] .*got \[5, 3\]"),
    "topk_ids range": (bad(topk_ids=torch.full((6, 2), -1)), r"topk_ids must lie in \[0, V = 50\)"),
    "bias shape": (bad(bias=torch.zeros(49)), r"bias must be \[50\] .*got \[49\]"),
    "ref shape": (bad(ref_log_probs=torch.zeros(6, 49)), r"ref_log_probs must be \[6, 50\] .*got \[6, 49\]"),
    "ref ints": (bad(ref_log_probs=torch.zeros(6, 50, dtype=torch.long)), r"ref_log_probs must be a floating-point"),
    "anchor shape": (
        bad(anchor_log_probs=torch.zeros(5, 50), divergence=gppo.divergence("kl")),
        r"anchor_log_probs must be \[6, 50\] .*got \[5, 50\]",
    ),
    "anchor alone": (bad(anchor_log_probs=lambda c: c.anchor), r"anchor_log_probs and divergence together"),
    "divergence alone": (bad(divergence=gppo.divergence("tv")), r"anchor_log_probs and divergence together"),
    "divergence name": (
        bad(anchor_log_probs=lambda c: c.anchor, divergence="kl"),
        r"divergence must be a gppo Divergence .*got str",
    ),
    "kept_sizes alone": (bad(kept_ids=None), r"kept_sizes and kept_ids .* pass both or neither"),
    "kept_ids alone": (bad(kept_sizes=None), r"kept_sizes and kept_ids .* pass both or neither"),
    "kept sum": (bad(kept_ids=lambda c: c.kept_ids[1:]), r"sum to len\(kept_ids\) = \d+, got sum \d+"),
    "kept negative": (
        bad(kept_sizes=lambda c: c.kept_sizes - 100 * (torch.arange(6) == 0) + 100 * (torch.arange(6) == 5)),
        r"kept_sizes must be >= 0 .*min -",
    ),
    "kept_sizes rows": (
        bad(kept_sizes=torch.zeros(5, dtype=torch.long), kept_ids=torch.zeros(0, dtype=torch.long)),
        r"kept_sizes must be \[6\] .*got \[5\]",
    ),
    "kept_ids range": (bad(kept_ids=lambda c: c.kept_ids + 50), r"kept_ids must lie in \[0, V = 50\)"),
    "chunk_size zero": (bad(chunk_size=0), r"chunk_size must be an integer >= 1 \(rows per chunk\), got 0; pass e.g."),
    "chunk_size float": (bad(chunk_size=2.0), r"chunk_size must be an integer >= 1 .*got 2.0"),
    "chunk_size bool": (bad(chunk_size=True), r"chunk_size must be an integer >= 1 .*got True"),
    "temperature nan": (bad(temperature=math.nan), r"temperature must be a finite number .*got nan"),
    "hidden list": (bad(hidden=[[0.0] * 16] * 6), r"hidden must be a torch.Tensor, got list"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_inputs_name_the_argument(name):
    call, message = BAD_INPUTS[name]
    with pytest.raises(ValueError, match=message):
        call()


def test_bfloat16_head_weight_gradient_is_summed_in_float32():
    """A bfloat16 output layer's weight gradient over 512 chunks against float64: each chunk's
    product is summed in float32, so the chunked gradient is no worse than one chunk's, in the
    worst entry and in norm (rounding each chunk's product to bfloat16 before the float32 sum made
    the worst entry 1.5x and the norm 1.2x worse on this case)."""
    gen = torch.Generator().manual_seed(21)
    n, width, vocab = 512, 64, 256
    hidden = torch.randn(n, width, generator=gen).bfloat16()
    weight = (torch.randn(vocab, width, generator=gen) / 8).bfloat16()
    token_ids = torch.randint(vocab, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen)

    def weight_gradient(w, h, chunk_size):
        w = w.detach().requires_grad_()
        stats = gppo.token_stats(h, w, token_ids, entropy=True, chunk_size=chunk_size)
        ((stats.logp * upstream).sum() + stats.entropy.sum()).backward()
        return w.grad.double()

    exact = weight_gradient(weight.double(), hidden.double(), None)
    one_chunk = weight_gradient(weight, hidden, None) - exact  # n x V = 2**17 logits: one chunk
    chunked = weight_gradient(weight, hidden, 1) - exact
    assert chunked.abs().max() <= 1.05 * one_chunk.abs().max()
    assert chunked.norm() <= 1.05 * one_chunk.norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_size", [3, None])
def test_logits_stats_matches_the_plain_computation_on_given_logits(dtype, chunk_size):
    """logits_stats on logits z [B, T, V] with a mask (-inf columns included, padding rows holding
    NaN): outputs equal the plain float64-reference computation at the masked-in positions and are 0
    elsewhere; gradients wrt the logits equal autograd's, and padding gets none."""
    case = make_case(n=12, vocab=60, dtype=dtype, seed=17)
    z = reference(case, 1.0)["logits"].detach().clone()
    z[:, :3] = -math.inf  # masked vocabulary columns
    mask = torch.ones(12, dtype=torch.bool)
    mask[[4, 9]] = False
    z[~mask] = math.nan  # padding may hold anything
    logits = z.view(3, 4, 60).requires_grad_()
    got = gppo.logits_stats(
        logits, case.token_ids.view(3, 4), mask=mask.view(3, 4), topk_ids=case.topk_ids.view(3, 4, -1),
        entropy=True, ref_log_probs=case.ref.view(3, 4, 60), anchor_log_probs=case.anchor.view(3, 4, 60),
        divergence=gppo.divergence("kl"), chunk_size=chunk_size,
    )  # fmt: skip
    log_pi = torch.log_softmax(z[mask].double(), -1)
    pi = log_pi.exp()
    cells = torch.where(pi > 0, log_pi, 0.0)
    want = dict(
        logp=log_pi.gather(1, case.token_ids[mask, None])[:, 0],
        topk_logp=log_pi.gather(1, case.topk_ids[mask]),
        entropy=-(pi * cells).sum(-1),
        kl_ref_full=(pi * torch.where(pi > 0, log_pi - case.ref[mask].double(), 0.0)).sum(-1),
        full_estimate=gppo.divergence("kl").between_log(log_pi, case.anchor[mask].double()),
    )
    tol = TOL[dtype] if dtype == torch.float64 else dict(rtol=1e-5, atol=2e-6)
    for name, value in want.items():
        out = getattr(got, name)
        assert out.shape[:2] == (3, 4) and bool((out.view(12, -1)[~mask] == 0).all()), name
        torch.testing.assert_close(out.view(12, *out.shape[2:])[mask].double(), value, **tol, msg=name)
    weights = [torch.randn(getattr(got, name).shape, dtype=torch.float64) for name in DIFFERENTIABLE]
    (mine,) = torch.autograd.grad(
        sum((getattr(got, n).double() * w).sum() for n, w in zip(DIFFERENTIABLE, weights)), logits
    )
    plain = z[mask].double().requires_grad_()
    log_pi = torch.log_softmax(plain, -1)
    pi = log_pi.exp()
    values = dict(
        logp=log_pi.gather(1, case.token_ids[mask, None])[:, 0],
        topk_logp=log_pi.gather(1, case.topk_ids[mask]),
        entropy=-(pi * torch.where(pi > 0, log_pi, 0.0)).sum(-1),
        kl_ref_full=(pi * torch.where(pi > 0, log_pi - case.ref[mask].double(), 0.0)).sum(-1),
    )
    (theirs,) = torch.autograd.grad(
        sum((values[n] * w.view(12, *w.shape[2:])[mask]).sum() for n, w in zip(DIFFERENTIABLE, weights)), plain
    )
    mine = mine.view(12, 60)
    assert bool((mine[~mask] == 0).all())
    torch.testing.assert_close(mine[mask].double(), theirs, **tol)


# every estimator, as a config that uses it (each also with the exact and the k3 KL penalty)
ESTIMATOR_POINTS = {
    "sample": ("gmpo", {}),
    "cell": ("ripo", {}),
    "binary": ("gppo", {}),
    "topk": ("dppo-topk-tv", {}),
    "topp": ("dppo-topk-tv", {"estimator": "topp", "top_p": 0.9}),
    "full": ("dppo-binary-kl", {"estimator": "full"}),
}


def near_policy_case(seed: int, nucleus: bool, temperature: float) -> Case:
    """A bfloat16 output layer with a bias (logits of std ~3 / T) and a rollout near its policy: mu
    (the anchor) and ref are pi's float64 logits plus N(0, 0.3^2) noise, so that r stays near 1 and
    the rules pass gradient; the token drawn from mu, topk_ids mu's top 20; with a nucleus, each
    row keeps its 25-200 most probable ids (mu and ref 0 elsewhere)."""
    gen = torch.Generator().manual_seed(seed)
    n, width, vocab = 12, 32, 500

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).bfloat16().requires_grad_()

    hidden, weight, bias = randn(n, width), randn(vocab, width, scale=0.5), randn(vocab)
    z = F.linear(hidden.double(), weight.double(), bias.double()).detach() / temperature
    kept = torch.ones(n, vocab, dtype=torch.bool)
    if nucleus:
        kept = z.argsort(-1, descending=True).argsort(-1) < torch.randint(25, 200, (n, 1), generator=gen)

    def near():
        noisy = z + 0.3 * torch.randn(n, vocab, generator=gen, dtype=torch.float64)
        return torch.log_softmax(noisy.masked_fill(~kept, -math.inf), -1).float()

    anchor, ref = near(), near()
    token_ids = torch.multinomial(anchor.exp(), 1, generator=gen)[:, 0]
    nucleus_inputs = (kept.sum(-1), kept.nonzero()[:, 1], kept) if nucleus else ()
    return Case(hidden, weight, bias, token_ids, anchor.topk(20, -1).indices, ref, anchor, *nucleus_inputs)


def loss_values(case: Case, values: dict, config) -> dict:
    """`values` (detached) and the gradients of gppo.policy_loss wrt hidden, weight and bias, the
    12 rows as 4 sequences of 3 tokens."""

    def seq(x):
        return x.reshape(4, 3, *x.shape[1:])

    batch = gppo.TokenBatch(
        logp=seq(values["logp"]),
        logp_behavior=seq(case.anchor.gather(1, case.token_ids[:, None])[:, 0]),
        advantages=torch.tensor([1.0, -0.5, 0.8, -1.3]),
        mask=torch.ones(4, 3),
        token_ids=seq(case.token_ids),
        topk_ids=seq(case.topk_ids),
        topk_logp=seq(values["topk_logp"]),
        topk_logp_behavior=seq(case.anchor.gather(1, case.topk_ids)),
        logp_ref=seq(case.ref.gather(1, case.token_ids[:, None])[:, 0]),
        entropy=seq(values["entropy"].detach()),
        full_estimate=seq(values["full_estimate"]) if "full_estimate" in values else None,
        kl_ref_full=seq(values["kl_ref_full"]) if "kl_ref_full" in values else None,
    )
    loss, _ = gppo.policy_loss(batch, config)
    gradients = torch.autograd.grad(loss, case.params())
    return {**{k: v.detach() for k, v in values.items()}, **dict(zip(("d hidden", "d weight", "d bias"), gradients))}


def bfloat16_errors(case: Case, config, temperature: float) -> dict:
    """{quantity: (kernel error, naive error)}: relative 2-norm errors against float64 of the
    kernel's outputs and of the policy_loss gradients, the kernel's (token_stats on the bfloat16
    layer) and the naive computation's (the full bfloat16 logits, then the float32 math of
    `reference`), float64 being `reference` on the same values widened (Divergence.between_log
    the full estimate's)."""
    outputs = ("logp", "topk_logp", "entropy")
    outputs += ("full_estimate",) * (config.anchor_distribution is not None)
    outputs += ("kl_ref_full",) * (config.reference_distribution is not None)

    def full_logits(c: Case) -> dict:
        values = reference(c, temperature)
        if "full_estimate" in outputs:
            log_pi, log_mu = values["log_probs"].detach(), torch.log_softmax(c.anchor.to(values["logits"].dtype), -1)
            values["full_estimate"] = config.divergence_fn.between_log(log_pi, log_mu)
        return loss_values(c, {o: values[o] for o in outputs}, config)

    widened = {name: getattr(case, name).detach().double().requires_grad_() for name in ("hidden", "weight", "bias")}
    exact = full_logits(replace(case, **widened))
    stats = run(case, temperature, 1, outputs, divergence=config.divergence)
    kernel = loss_values(case, {o: getattr(stats, o) for o in outputs}, config)
    naive = full_logits(case)

    def error(x, want):
        assert want.norm() > 0  # the case exercises every quantity
        return ((x.double() - want).norm() / want.norm()).item()

    return {q: (error(kernel[q], exact[q]), error(naive[q], exact[q])) for q in exact}


@pytest.mark.parametrize("estimator", list(ESTIMATOR_POINTS))
@pytest.mark.parametrize("kl_estimator", ["k3", "full"])
@pytest.mark.parametrize("nucleus", [False, True])
def test_bfloat16_kernel_is_as_accurate_as_the_full_logits(estimator, kl_estimator, nucleus):
    """A bfloat16 output layer with a bias, every estimator, the exact (or k3) KL penalty, with and
    without a nucleus, one row per chunk: against float64, each output of the kernel (log-prob,
    top-K log-probs, entropy, exact D_f, exact KL) and each gradient of the loss (hidden states,
    weight, bias) is as accurate as the naive full-logits computation's, draw by draw. The kernel
    rounds the logits' gradient to bfloat16 as autograd does and sums the rest in float32, so only
    the summation order differs (< 0.1 % in these errors); c = 1.05 catches one bfloat16 rounding
    more or less, which moves the error by its own order: summing the unrounded logits' gradient
    (aa628c7) put the bias gradient's error at 0.7x-1.5x the naive one here (2.4x on the issue's
    case), rounding each chunk's weight product to bfloat16 (c3104e1) the weight's at up to 1.07x."""
    name, overrides = ESTIMATOR_POINTS[estimator]
    config = gppo.preset(name, **overrides, kl_coef=0.1, kl_estimator=kl_estimator)
    for seed in range(4):
        case = near_policy_case(seed, nucleus, 0.7)
        for quantity, (mine, naive) in bfloat16_errors(case, config, 0.7).items():
            assert mine <= 1.05 * naive + 1e-7, (quantity, seed, mine, naive)
