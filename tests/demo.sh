#!/usr/bin/env bash
# tests/demo.sh - from a bare Debian 12 host (root) to a healthy `systemctl status dflash`:
# host setup, the local Proxmox stand-in (LXC CT 200 booted with systemd, an sshd on
# 127.0.0.1:2222 playing the node, the pct shim), then the real deploy.yml against it, which
# stages the tiny target, installs the trainer from a wheel, templates run.sh and the unit and
# waits until the job trains. Leaves everything running; `tests/standin/standin.sh down` (or
# `molecule destroy`) removes it.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

tests/setup-host.sh
# shellcheck disable=SC1091
source .venv/bin/activate

tests/standin/standin.sh up
ansible-playbook -i inventory/local deploy.yml --skip-tags provision
ansible-playbook -i inventory/local playbooks/status.yml

echo
echo "+ pct exec 200 -- systemctl status dflash --no-pager"
pct exec 200 -- systemctl status dflash --no-pager
