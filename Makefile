# The README's two commands: `make demo` (the whole pipeline on the embedded house target) and `make test`.
# Both bootstrap .venv on a fresh machine (CPU torch 2.13.0) and install the package with its extras.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
RUN    ?= runs/demo

.PHONY: install demo test test-unit test-integration test-distributed clean-demo

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev,deepspeed,wandb,serve,regenerate]"
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

demo: install
	$(BIN)/speculators run recipes/house-eagle3.yaml run_dir=$(RUN)/eagle3 train.epochs=2
	$(BIN)/speculators bench --speculator $(RUN)/eagle3/export --rows-per-cohort 2 --temperatures 0 --out $(RUN)/bench

test: install
	$(BIN)/python -m pytest tests -q -x --timeout 900

test-unit: install
	$(BIN)/python -m pytest tests/unit -q

test-integration: install
	$(BIN)/python -m pytest tests/integration -q

test-distributed: install
	$(BIN)/python -m pytest tests/distributed -q

clean-demo:
	rm -rf $(RUN)
