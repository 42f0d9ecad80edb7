"""What a LoRA adapter adds to one linear layer of the update, forward + backward, on a CPU.

SmolLM2-135M's widest projection (576 -> 1536, the MLP's gate and up) on a 512-token
micro-batch (the main job's `optim.max_tokens_per_microbatch`), fp32, the base weight frozen:

* `frozen`: the linear alone (the input's gradient still flows through it);
* `lora`: as peft computes it, `x @ W.T + (x @ A.T) @ B.T * scaling` (rank 8);
* `lora, addmm`: the scaling and the sum folded into one `torch.addmm`: the fused form.

Each is timed as the best of 3 rounds of `--repeats` forward + backward passes; the fused
form's output and gradients are checked against peft's form.

    python bench/lora_layer.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

TOKENS, IN, OUT, RANK, SCALING = 512, 576, 1536, 8, 2.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    weight = torch.randn(OUT, IN) * 0.02
    lora_a = (torch.randn(RANK, IN) * 0.02).requires_grad_()
    lora_b = (torch.randn(OUT, RANK) * 0.02).requires_grad_()
    inputs = torch.randn(TOKENS, IN)

    forms: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "frozen": lambda x: x @ weight.t(),
        "lora": lambda x: x @ weight.t() + (x @ lora_a.t()) @ lora_b.t() * SCALING,
        "lora, addmm": lambda x: torch.addmm(
            x @ weight.t(), x @ lora_a.t(), lora_b.t(), alpha=SCALING
        ),
    }

    def grads(form: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        lora_a.grad = lora_b.grad = None
        x = inputs.clone().requires_grad_()
        out = form(x)
        out.backward(torch.ones_like(out))
        return [out.detach(), x.grad, lora_a.grad, lora_b.grad]

    def best_ms(form: Callable[[torch.Tensor], torch.Tensor]) -> float:
        rounds = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(args.repeats):
                grads(form)
            rounds.append(time.perf_counter() - start)
        return min(rounds) / args.repeats * 1e3

    times = {name: best_ms(form) for name, form in forms.items()}
    for name, ms in times.items():
        print(f"{name:12} {ms:7.3f} ms  ({ms / times['frozen']:.2f}x frozen)")
    diffs = [
        (a - b).abs().max().item()
        for a, b in zip(grads(forms["lora"]), grads(forms["lora, addmm"]), strict=True)
    ]
    print("addmm vs peft's form, max |difference| of output, dx, dA, dB:", diffs)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
