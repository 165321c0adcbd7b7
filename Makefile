# k3train: two commands for a newcomer on a fresh machine.
#   make train   -- set up .venv, build the shipped corpus, train the tiny K3 config on CPU with 2 processes
#   make test    -- set up .venv, build the shipped corpus, run the whole test suite
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
CONFIG ?= configs/tiny.yaml
LAYOUT ?= --parallel.pp=2 --parallel.vpp=2
ARGS   ?=
DATA   := data_cache/corpus_text_document
DATA_MM := data_cache/mm

.PHONY: train test venv data data-mm clean count bench plot

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $@

data: $(DATA).bin
$(DATA).bin: $(VENV)/.installed tools/prepare_data.py k3train/data/assets/kjv.txt.gz k3train/data/assets/tokenizer.json
	$(PY) tools/prepare_data.py --shipped-corpus --output-prefix $(DATA)

# the shipped multimodal corpus (k3train/data/multimodal/shipped.py), for data.format=multimodal runs
data-mm: $(DATA_MM).bin
$(DATA_MM).bin: $(VENV)/.installed tools/prepare_data.py k3train/data/assets/kjv.txt.gz k3train/data/assets/tokenizer-vl.json k3train/data/multimodal/shipped.py
	$(PY) tools/prepare_data.py --shipped-multimodal --output-prefix $(DATA_MM)

# `k3train train` validates once (bad input: one line, exit 2, nothing started), then launches torchrun
train: venv data
	WANDB_MODE=$${WANDB_MODE:-offline} OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/k3train train \
		--config $(CONFIG) --nproc $(NPROC) $(LAYOUT) $(ARGS)

test: venv data data-mm
	OMP_NUM_THREADS=1 $(PY) -m pytest tests

# re-measure every figure docs/ and benchmarks/results/ claim (benchmarks/bench_readme.py; ~35 min on an idle 2-core
# machine; refuses while it is busy): make bench ARGS="--only kda,planner --json bench.json"
bench: venv data data-mm
	$(PY) benchmarks/bench_readme.py $(ARGS)

count: venv
	$(VENV)/bin/k3train count --config configs/k3.yaml

# the curves of the `make train` run (RUNS: run directories to overlay)
RUNS ?= runs/tiny
plot: venv
	$(VENV)/bin/k3train plot $(RUNS) -o docs/make_train_loss.png

clean:
	rm -rf runs data_cache
