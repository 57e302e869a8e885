#!/usr/bin/env bash
# tests/setup-host.sh - everything a newcomer or CI needs on a Debian 12 host (root) to run the
# local stand-in, the molecule scenario and the tests. Idempotent: a second run installs nothing.
#   - apt: lxc, debootstrap, openssh (the node's sshd), rsync, python3-venv
#   - <repo>/.venv: torch 2.13.0 CPU first (so nothing pulls a CUDA build), then the trainer
#     (pip install -e ., compat mode), the controller's pinned requirements (requirements.txt: ansible-core,
#     proxmoxer, requests, paramiko, setuptools, wheel) and the test tools (molecule,
#     ansible-runner, ansible-lint, pytest, ruff: pinned, as its findings change between releases);
#     the collections of requirements.yml.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DFLASH_VENV:-$REPO/.venv}"
TORCH_VERSION=2.13.0
APT_PACKAGES=(lxc debootstrap openssh-server openssh-client rsync python3 python3-venv python3-pip ca-certificates)

log() { echo "setup-host: $*" >&2; }
[[ $EUID -eq 0 ]] || { log "run as root (apt, lxc)"; exit 1; }

missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

[[ -x "$VENV/bin/python" ]] || { log "python3 -m venv $VENV"; python3 -m venv "$VENV"; }
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# torch first, CPU build: a local wheel when the host has one, else PyTorch's CPU index.
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') and '+cu' not in torch.__version__ else 1)" 2>/dev/null; then
    wheel="$(ls /opt/wheels/torch-${TORCH_VERSION}+cpu-*.whl 2>/dev/null | head -1 || true)"
    if [[ -n "$wheel" ]]; then
        log "pip install $wheel"
        "${PIP[@]}" install -q "$wheel"
    else
        log "pip install torch==$TORCH_VERSION (CPU index)"
        "${PIP[@]}" install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu \
            --extra-index-url https://pypi.org/simple
    fi
fi

stamp="$VENV/.dflash-setup"
want="$(sha256sum "$REPO/pyproject.toml" "$REPO/requirements.txt" "$0" | sha256sum | cut -c1-16)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    log "pip install -e $REPO, -r requirements.txt and the test tools"
    # editable_mode=compat: the repo on sys.path by a plain path in a .pth file. setuptools' default editable
    # install puts an import finder in the .pth instead, which every start of this venv's python ran (pathlib,
    # urllib.parse, ipaddress...): 28 ms a start against 10 (2026-12-06), thousands of times a run (each
    # Ansible module run on the controller, each rank, each CLI). trainer.lab stays importable either way.
    "${PIP[@]}" install -q -e "$REPO[fp8,real]" --config-settings editable_mode=compat -r "$REPO/requirements.txt" \
        molecule ansible-runner ansible-lint pytest ruff==0.17.5
    # the test extra (the reference dflash package) without its pins: they would move transformers to 5.24
    # and huggingface_hub to 1.x under every other test; its model code needs only torch and transformers
    "${PIP[@]}" install -q --no-deps $("$VENV/bin/python" -c 'import sys, tomllib
print(*tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["test"])' "$REPO/pyproject.toml")
    echo "$want" > "$stamp"
fi
# The collections of requirements.yml, at their pinned versions. Where Galaxy cannot be reached
# (this CI reaches PyPI only) the community `ansible` package of the release that bundles the same
# version is the fallback; either way the version is checked.
collections_ok() {
    "$VENV/bin/python" - "$REPO/requirements.yml" "$VENV/bin/ansible-galaxy" <<'PY'
import json, subprocess, sys, yaml
want = yaml.safe_load(open(sys.argv[1]))["collections"]
for c in want:
    r = subprocess.run([sys.argv[2], "collection", "list", c["name"], "--format", "json"], capture_output=True, text=True)
    have = {v[c["name"]]["version"] for v in (json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {}).values()}
    if str(c["version"]) not in have:
        sys.exit(1)
PY
}
# The bundle holds about 90 collections (15,000 Python files); the roles use community.proxmox alone, so
# only it is byte-compiled (pip's compile of them all: 14 of the install's 19 CPU-s on this 2-core host).
ansible_bundle() {
    "${PIP[@]}" install -q --no-compile ansible==12.3.0
    "$VENV/bin/python" -m compileall -q "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ansible_collections/community/proxmox"
}
if ! collections_ok; then
    log "ansible-galaxy collection install -r requirements.yml"
    "$VENV/bin/ansible-galaxy" collection install -r "$REPO/requirements.yml" --timeout 30 \
        || { log "Galaxy unreachable: pip install ansible==12.3.0 (bundles community.proxmox 1.4.0)"; ansible_bundle; }
    collections_ok || { log "the collections of requirements.yml are not installed at their versions"; exit 1; }
fi
log "ok: $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'), $("$VENV/bin/ansible" --version | sed -n 1p))"
