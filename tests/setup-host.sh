#!/usr/bin/env bash
# tests/setup-host.sh - everything a newcomer or CI needs on a Debian 12 host (root) to run the
# local stand-in, the molecule scenario and the tests. Idempotent: a second run installs nothing.
#   - apt: lxc, debootstrap, openssh (the node's sshd), rsync, python3-venv
#   - <repo>/.venv: torch 2.13.0 CPU first (so nothing pulls a CUDA build), then the trainer
#     (pip install -e .) and the Ansible side: ansible (ansible-core + community.proxmox),
#     paramiko, proxmoxer, molecule, ansible-runner, ansible-lint, pytest.
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
want="$(sha256sum "$REPO/pyproject.toml" "$0" | sha256sum | cut -c1-16)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    log "pip install -e $REPO and the Ansible toolchain"
    "${PIP[@]}" install -q -e "$REPO[fp8]" ansible paramiko proxmoxer requests molecule ansible-runner ansible-lint pytest
    echo "$want" > "$stamp"
fi
"$VENV/bin/ansible-galaxy" collection list community.proxmox >/dev/null 2>&1 \
    || "$VENV/bin/ansible-galaxy" collection install community.proxmox ansible.posix
log "ok: $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'), $("$VENV/bin/ansible" --version | sed -n 1p))"
