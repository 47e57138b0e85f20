# kvpush: push-mode KV-cache transfer for P/D disaggregated vLLM.
PY      := .venv/bin/python
STAMP   := .venv/.kvpush-stamp
PROTO_SRC := proto/kvpush/v1/kvpush.proto
export UCX_NET_DEVICES ?= lo
export NIXL_LOG_LEVEL ?= WARN
export VLLM_NO_USAGE_STATS ?= 1

.PHONY: install system-deps lock proto proto-check typecheck check test test-mp test-core lint gpu-check bench bench-transfer bench-scheduler bench-handoff bench-phases bench-connector-cost bench-decode-speed bench-pool bench-relay bench-request-start soak test-faults demo certs install-systemd clean

# Idempotent: a no-op when .venv matches requirements.lock and pyproject.toml.
install:
	@scripts/install.sh

# systemd-analyze for the unit-file test (apt, when missing and root).
system-deps:
	@scripts/system_deps.sh

lock:
	UV=.venv/bin/uv scripts/lock.sh

# Generated code (messages, gRPC stubs, type stubs) is produced here only, and committed.
proto: install
	$(PY) -m grpc_tools.protoc -Iproto \
	  --python_out=proto --grpc_python_out=proto \
	  --mypy_out=proto --mypy_grpc_out=proto \
	  --plugin=protoc-gen-mypy=.venv/bin/protoc-gen-mypy \
	  --plugin=protoc-gen-mypy_grpc=.venv/bin/protoc-gen-mypy_grpc \
	  $(PROTO_SRC)

# Fails when the committed generated code differs from a fresh `make proto`.
proto-check: install
	@scripts/proto_check.sh

lint: install
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

# mypy --strict over kvpush.services and kvpush.connector (scripts/typecheck.sh).
typecheck: install
	scripts/typecheck.sh

# Static checks: generated code up to date, lint and format, types.
check: proto-check lint typecheck

# Everything CI runs: the static checks, then every test (real gRPC, NIXL and vLLM).
test: install system-deps check
	$(PY) -m pytest -q -ra --durations=15 tests
	$(MAKE) --no-print-directory test-mp

# The P/D end-to-end tests again with vLLM's multiprocess executor (its CPU default, and the shape
# of a tensor-parallel engine): the connector's scheduler and worker halves in separate processes.
test-mp: install
	KVPUSH_VLLM_EXECUTOR=mp $(PY) -m pytest -q -ra tests/test_pd_e2e.py tests/test_first_token_e2e.py tests/test_first_token_veto_e2e.py tests/test_pd_faults.py

# The fault-injection suite alone (all of it also runs in `make test`): kill -9, cut, drop,
# duplicate, delay, restart, on the transfer core, network namespaces and real vLLM.
test-faults: install
	$(PY) -m pytest -q -ra tests/test_transfer_faults.py tests/test_netns.py tests/test_pd_faults.py \
	  tests/test_transfer_e2e.py -k "fault or kill or restart or cut or stall or frozen or drop or dup or late or namespace or netns or retried"

test-core: install
	$(PY) -m pytest -q -ra -m "not vllm" tests

# Data plane on one GPU (VRAM layouts, CUDA-event fence, NIXL over cuda_ipc/cuda_copy); skips
# with a message and exit 0 where no CUDA device is present. Needs a CUDA torch and nixl in .venv.
gpu-check:
	timeout 300 $(PY) -m scripts.gpu_check

bench-transfer: install
	$(PY) -m benchmarks.transfer $(ARGS)

bench-scheduler: install
	$(PY) -m benchmarks.scheduler $(ARGS)

# Light load, side by side with one plain instance: the hand-off cost of the push path.
bench-handoff: install
	$(PY) -m benchmarks.handoff $(ARGS)

# Where a P/D request's time goes, paired with plain requests on the same engines (benchmarks/phases.py).
bench-phases: install
	$(PY) -m benchmarks.phases $(ARGS)

# What the connector costs a decode engine per step: its hooks and threads switched off and on
# inside one launch, paired per prompt (benchmarks/connector_cost.py).
bench-connector-cost: install
	$(PY) -m benchmarks.connector_cost $(ARGS)

# The decode engine's own speed: plain requests on it against a plain vLLM and a vLLM holding a
# do-nothing KV connector on the same core, with P/D traffic between them or not
# (benchmarks/decode_speed.py; ARGS="--pd 1 --generate 1" adds it, and measures those requests too).
bench-decode-speed: install
	$(PY) -m benchmarks.decode_speed $(ARGS)

# Pools launches of bench-decode-speed, one JSON result each, per arm (its --serving-arg):
# make bench-pool ARGS="bench-results/ds-*.json" (benchmarks/launches.py).
bench-pool: install
	$(PY) -m benchmarks.launches $(ARGS)

# Generate's token relay alone (a fake engine, the real scheduler): CPU per relayed token at light
# load and under many streams (benchmarks/relay.py).
bench-relay: install
	$(PY) -m benchmarks.relay $(ARGS)

# What vLLM itself takes to start a request whose prompt KV is cached (a prefix hit on one plain
# instance): the floor under P/D's "D release -> first token" (benchmarks/request_start.py).
bench-request-start: install
	$(PY) -m benchmarks.request_start $(ARGS)

bench: install
	$(PY) -m benchmarks.serving $(if $(QUICK),--quick,) $(ARGS)

# 20 minutes of load through Generate on 2P1D with random faults (kill -9 and SIGSTOP prefill,
# scheduler restart, kill -9 decode); writes docs/soak.md and docs/img/soak_rss.png. Not in CI.
soak: install
	$(PY) -m benchmarks.soak $(ARGS)

demo: install
	$(PY) -m scripts.demo $(ARGS)

# Development PKI for mTLS in certs/: a CA, scheduler, frontend and per-engine certificates
# (default prefill-0 decode-0), and the leg-signing key pair. Keeps an existing CA.
# E.g. make certs ARGS="prefill-0 prefill-1 decode-0 decode-1 --host 10.0.0.11"; ARGS=--force renews all.
certs: install
	$(PY) -m scripts.make_certs $(ARGS)

DESTDIR ?=
PREFIX  ?= /opt/kvpush
# Units name /opt/kvpush; another PREFIX is substituted at install time.
install-systemd:
	install -d $(DESTDIR)/etc/systemd/system $(DESTDIR)/etc/kvpush
	for f in deploy/systemd/*.service; do \
	  sed 's#/opt/kvpush#$(PREFIX)#g' $$f > $(DESTDIR)/etc/systemd/system/$$(basename $$f) && \
	  chmod 0644 $(DESTDIR)/etc/systemd/system/$$(basename $$f) || exit 1; done
	for f in deploy/systemd/env/*.env; do \
	  sed 's#/opt/kvpush#$(PREFIX)#g' $$f > $(DESTDIR)/etc/kvpush/$$(basename $$f) && \
	  chmod 0640 $(DESTDIR)/etc/kvpush/$$(basename $$f) || exit 1; done

clean:
	rm -rf .venv .pytest_cache
