"""The one choice of a batch's draw (layers/sampler.py's pick_path) and the Sampler's fused
paths taken through its forward: on a CPU the kernels run under the Triton interpreter
(conftest.py), and for seeded rows they draw the tokens of the PyTorch paths."""

import pytest
import torch

from nanovllm_final.kernels import dispatch
from nanovllm_final.layers.sampler import Path, Sampler, pick_path


@pytest.mark.parametrize(
    "args, path",
    [
        (dict(verify=True, all_greedy=True, max_k=4, masks=True), Path.VERIFY),
        (dict(all_greedy=True, max_k=4, masks=True), Path.GREEDY),
        (dict(max_k=4, masks=True), Path.CANDIDATES),
        (dict(max_k=4, masks=True, fused=True), Path.FUSED_CANDIDATES),
        (
            dict(max_k=100, masks=True, fused=True),
            Path.MASKED,
        ),  # max_k not below the vocabulary: no candidates
        (dict(masks=True, fused=True), Path.MASKED),
        (dict(), Path.TEMPERATURE),
        (dict(fused=True), Path.FUSED_TEMPERATURE),
    ],
)
def test_pick_path(args, path):
    assert pick_path(100, args.pop("fused", False), **args) is path


@pytest.mark.parametrize(
    "fused, reference, masks",
    [
        (Path.FUSED_TEMPERATURE, Path.TEMPERATURE, False),
        (Path.FUSED_CANDIDATES, Path.CANDIDATES, True),
    ],
)
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU tensors reach the kernels only under the Triton interpreter (CPU machines); "
    "tests/test_fused_kernels.py checks the kernels on CUDA",
)
def test_fused_paths_draw_the_pytorch_paths_tokens(fused, reference, masks, monkeypatch):
    kernel = "candidates_draw" if masks else "gumbel_argmax"
    launches = []
    run = getattr(dispatch.sampling, kernel)
    monkeypatch.setattr(
        dispatch.sampling, kernel, lambda *args: launches.append(kernel) or run(*args)
    )
    g = torch.Generator().manual_seed(3)
    rows, vocab, k = 12, 300, 8
    logits = torch.randn(rows, vocab, generator=g) * 3
    temperatures = torch.rand(rows, generator=g) + 0.2
    temperatures[::4] = 0.0  # greedy rows among the others
    seeds, positions = (
        torch.randint(0, 2**40, (rows,), generator=g),
        torch.randint(0, 99, (rows,), generator=g),
    )
    top_k = torch.randint(1, k + 1, (rows,), generator=g) if masks else None
    top_p = torch.full((rows,), 0.9) if masks else None

    def draw(path: Path) -> torch.Tensor:
        return Sampler(seed=0, device=torch.device("cpu"))(
            logits,
            temperatures,
            top_k,
            top_p,
            seeds=seeds,
            positions=positions,
            max_k=k if masks else None,
            path=path,
        )

    out = draw(fused)
    assert launches == [kernel]
    assert torch.equal(out, draw(reference)) and launches == [kernel]
    assert torch.equal(out[::4], logits[::4].argmax(-1))
    assert not torch.equal(out, logits.argmax(-1))  # the other rows draw
