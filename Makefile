# make deps | build | lint | test | demo | bench
SHELL := /bin/bash
export LANG := C.UTF-8
export LC_ALL := C.UTF-8
export MIX_ENV ?= dev

APT_PACKAGES := elixir erlang-dev erlang-proper erlang-jiffy redis-server
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: deps build lint test demo bench

deps:
	@if ! command -v elixir >/dev/null || ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then \
	  $(SUDO) apt-get update && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y $(APT_PACKAGES); \
	fi
	@command -v cargo >/dev/null || { echo "cargo not found: install Rust (https://rustup.rs)"; exit 1; }

build: deps
	mix compile

lint: deps
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	mix format --check-formatted
	MIX_ENV=test mix compile --warnings-as-errors

test: lint
	cargo test --workspace --release
	MIX_ENV=test mix test
	python3 -m unittest discover -s test/cross_process

demo: build
	mix run demo/demo.exs

bench: build
	mix run bench/run.exs
