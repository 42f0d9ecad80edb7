"""What a LoRA adapter adds to the linear layers of the update, forward + backward, on a CPU.

SmolLM2-135M's projections (q and o 576 -> 576, k and v 576 -> 192, gate and up 576 -> 1536,
down 1536 -> 576) on a `--tokens` micro-batch (354: one prompt unit of the main job), fp32,
the base weight frozen:

* `frozen`: the linear alone (the input's gradient still flows through it);
* `lora`: as peft computes it, `x @ W.T + (x @ A.T) @ B.T * scaling` (rank 8);
* `lora, addmm`: the scaling and the sum folded into one `torch.addmm`;
* `fused`: trainer/learner/fast_lora.py, one autograd function with the rank as the rows of every
  small product (what the learner runs).

Each is timed as the best of 3 rounds of `--repeats` forward + backward passes; the other
forms' outputs and gradients are checked against peft's form. The last row sums one
decoder layer (its seven projections).

    python bench/lora_layer.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from masenvs.trainer.learner.fast_lora import lora_linear

RANK, SCALING = 8, 2.0
LAYER = {"q, o": (576, 576, 2), "k, v": (576, 192, 2), "gate, up": (576, 1536, 2),
         "down": (1536, 576, 1)}  # name: (in, out, how many per decoder layer)  # fmt: skip
Form = Callable[[torch.Tensor], torch.Tensor]


def forms(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> dict[str, Form]:
    return {
        "frozen": lambda x: x @ weight.t(),
        "lora": lambda x: x @ weight.t() + (x @ a.t()) @ b.t() * SCALING,
        "lora, addmm": lambda x: torch.addmm(x @ weight.t(), x @ a.t(), b.t(), alpha=SCALING),
        "fused": lambda x: lora_linear(x, weight, a, b, SCALING),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=354)
    args = parser.parse_args()
    torch.manual_seed(0)
    totals: dict[str, float] = {}
    print(f"{'projection':12}" + "".join(f"{name:>22}" for name in forms(*[None] * 3)))
    for label, (n_in, n_out, count) in LAYER.items():
        weight = torch.randn(n_out, n_in) * 0.02
        a = (torch.randn(RANK, n_in) * 0.02).requires_grad_()
        b = (torch.randn(n_out, RANK) * 0.02).requires_grad_()
        inputs, grad_out = torch.randn(args.tokens, n_in), torch.randn(args.tokens, n_out)

        def grads(form: Form) -> list[torch.Tensor]:
            a.grad = b.grad = None  # noqa: B023 (run inside this iteration)
            x = inputs.clone().requires_grad_()  # noqa: B023
            out = form(x)
            out.backward(grad_out)  # noqa: B023
            return [out.detach(), x.grad, a.grad, b.grad]  # noqa: B023

        def best_ms(form: Form) -> float:
            rounds = []
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(args.repeats):
                    grads(form)
                rounds.append(time.perf_counter() - start)
            return min(rounds) / args.repeats * 1e3

        variants = forms(weight, a, b)
        reference = grads(variants["lora"])
        for name in ("lora, addmm", "fused"):
            for ours, theirs in zip(grads(variants[name]), reference, strict=True):
                scale = theirs.abs().max().item()  # float sums in another order
                torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5 * scale)
        times = {name: best_ms(form) for name, form in variants.items()}
        for name, ms in times.items():
            totals[name] = totals.get(name, 0.0) + count * ms
        cells = [f"{ms:8.3f} ms ({ms / times['frozen']:.2f}x)" for ms in times.values()]
        print(f"{label:12}" + "".join(f"{c:>22}" for c in cells))
    cells = [f"{ms:8.3f} ms ({ms / totals['frozen']:.2f}x)" for ms in totals.values()]
    print(f"{'layer':12}" + "".join(f"{c:>22}" for c in cells))
    print(
        f"{args.tokens} tokens, rank {RANK}, fp32; outputs and gradients match peft's form; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )


if __name__ == "__main__":
    main()
