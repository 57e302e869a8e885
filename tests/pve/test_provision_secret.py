"""The API token secret never reaches the console, and a pasted one with its newline works (issue 62
A1), and the token's privileges are checked over its whole effective map (issue 62 C2, C5).

playbooks/provision.yml against the PVE API stand-in with --fake-lxc (the fixture of
test_provision_playbook.py): every way the provision role can fail is run with a known secret, at
`-v`, and its output must not contain that secret in any spelling an HTTP client quotes it in.
"""

from __future__ import annotations

import socket

import pytest

import tests.pve.test_provision_playbook as test_provision_playbook
from tests.pve.test_provision import TEMPLATE, prov_filters
from tests.pve.test_provision_playbook import NETIF, VMID, api_config, cases_play, host_failed, play

pytestmark = [pytest.mark.provision, pytest.mark.slow]
node = test_provision_playbook.node       # the fixture: the stand-in node and an inventory for CT 250

# what a real secret looks like (a UUID), so that no other text of the output can hold it by chance
KNOWN = "5e1d0b6e-9c1f-4c36-a0a2-7c1d2f0e3b4a"
VALID = "s3cret"                      # the fixture's tokens' secret


def _spellings(secret: str) -> list:
    """The secret as given, trimmed, and as a bytes or str repr shows it (`\\n` for a newline)."""
    forms = {secret, secret.strip(), secret.encode("unicode_escape").decode(), repr(secret)[1:-1]}
    return sorted(f for f in forms if len(f) >= 6)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _secret_free(r, secret: str) -> None:
    out = r.stdout + r.stderr
    for form in _spellings(secret):
        assert form not in out, (form, out[-3000:])


def _grant_extra_token(node, extra_acl: str) -> None:
    """A token root@pam!extra with exactly the documented ACLs for CT 250, plus `extra_acl`, as
    `pveum` leaves them in user.cfg and priv/token.cfg; the stand-in reads both at once."""
    etc = node["conf"].parent.parent
    acl = prov_filters.dflash_token_acl(VMID, "local-lvm", TEMPLATE, NETIF)
    lines = [x for x in prov_filters.dflash_user_cfg_lines(acl, "root@pam!extra", "DFlashProvision")
             if not x.startswith("role:")] + [extra_acl]
    (etc / "user.cfg").write_text((etc / "user.cfg").read_text() + "\n".join(lines) + "\n")
    (etc / "priv").mkdir(exist_ok=True)
    (etc / "priv" / "token.cfg").write_text(f"root@pam!extra {VALID}\n")


def _cases_play(node, name: str, cases: list, *args):
    """One run with a host per case, case0, case1, ... (cases_play): each CT 250 with the case's variables
    and its secret as its host variables."""
    return cases_play(node, name, {f"case{i}": {**extra, "dflash_provision_api_token_secret": secret}
                                   for i, (extra, secret, _) in enumerate(cases)}, *args)


def _each_fails(r, cases: list) -> None:
    """Every case's host failed, with its own message, and no case's secret is in the output."""
    for i, (extra, secret, says) in enumerate(cases):
        assert says in host_failed(r, f"case{i}"), (extra, r.text[-3000:])
        _secret_free(r, secret)


def test_no_fail_path_of_the_provision_role_shows_the_secret_and_a_pasted_one_works(node):
    """Before CT 250 exists: the memory budget, an API that cannot be reached, an untrusted
    certificate, a refused token, a secret that no header may carry (a newline inside it), a token
    lacking a privilege, one holding too many, a grant elsewhere in the whole map, a template the
    storage lacks. Then the secret as the usual paste leaves it (a trailing newline) provisions CT
    250, and with it existing: privileged or not, the rootfs size, a module's own failure.

    The failing cases of each part run as the hosts of one run (one host per case, its variables
    its own): each host's failure is its own case's, and the output of all of them holds no
    case's secret."""
    failing = [
        ({"dflash_provision_memory_mib": 100}, KNOWN + "\n", "memory 100 MiB is smaller than"),
        ({"dflash_provision_api_port": _closed_port()}, KNOWN + "\n", "Cannot reach the Proxmox API at"),
        ({"dflash_provision_ca_bundle": ""}, KNOWN, "The node's certificate is not trusted"),
        ({}, KNOWN, "refused token root@pam!ansible: HTTP 401 invalid token value!"),
        ({}, KNOWN[:18] + "\n" + KNOWN[18:], "Cannot reach the Proxmox API at"),
        ({"dflash_provision_api_token_id": "nosdn"}, VALID, "Token root@pam!nosdn lacks SDN.Use"),
        ({"dflash_provision_api_token_id": "shared"}, VALID, "holds privileges it does not need"),
        ({"dflash_provision_ostemplate": "local:vztmpl/debian-12-standard_12.2-1_amd64.tar.zst"}, VALID + "\n",
         "(dflash_provision_ostemplate) is not on storage local"),
    ]
    r = _cases_play(node, "failing", failing, "-v")
    _each_fails(r, failing)
    assert not node["conf"].exists()

    # the usual paste: the secret with the newline Enter left; it is trimmed, and the CT is made
    r = play(node, "-v", dflash_provision_api_token_secret=VALID + "\n")
    assert r.returncode == 0, r.text[-4000:]
    assert api_config(node)["hostname"] == "ct250"
    _secret_free(r, VALID + "\n")

    existing = [
        ({"dflash_provision_unprivileged": False}, VALID + "\n", "CT 250 exists and is unprivileged"),
        ({"dflash_provision_rootfs_gib": 8}, VALID + "\n", "`pct resize 250 rootfs 8G`"),
        ({"dflash_provision_node": "nope"}, VALID + "\n", "nope"),
    ]
    r = _cases_play(node, "existing", existing, "-v")
    _each_fails(r, existing)


def test_a_grant_anywhere_beyond_what_the_token_needs_fails_naming_the_path(node):
    """Issue 62 C2: the excess check read only the token's own paths and /, so a grant on /nodes or
    another VM passed. The whole effective map (GET /access/permissions without a path) shows it."""
    _grant_extra_token(node, "acl:1:/nodes/pve:root@pam!extra:PVEAuditor:")
    r = play(node, "--check", dflash_provision_api_token_id="extra")
    assert r.returncode != 0, r.text[-3000:]
    assert "Token root@pam!extra (dflash_provision_api_user / dflash_provision_api_token_id) holds privileges it" \
        " does not need: Datastore.Audit, Mapping.Audit, Pool.Audit, SDN.Audit, Sys.Audit, VM.Audit on /nodes/pve." \
        in r.text, r.text[-3000:]


def test_a_refused_token_gets_the_lines_of_both_pve_majors_for_a_privileged_ct(node):
    """Issue 62 C5: the 401 message's `pveum` lines were computed before the node's version is
    known; for a privileged CT on PVE 9 they left out Sys.Modify on /. Now PVE 9's extra lines follow."""
    r = play(node, "--check", dflash_provision_api_token_secret=KNOWN, dflash_provision_unprivileged=False)
    assert r.returncode != 0 and "HTTP 401" in r.text, r.text[-3000:]
    assert "; on PVE 9 and later also: pveum role add DFlashProvisionSys --privs \"Sys.Modify\"; pveum acl modify /" \
        " --tokens 'root@pam!ansible' --roles DFlashProvisionSys --propagate 0" in r.text, r.text[-3000:]
    r = play(node, "--check", dflash_provision_api_token_secret=KNOWN)
    assert "on PVE 9 and later also" not in r.text                    # an unprivileged CT: the same on both


def test_the_secret_is_trimmed_where_it_is_defined():
    """The production inventory and the role's default trim what the vault or the environment give."""
    from tests.pve.test_provision import REPO
    assert "| trim }}" in (REPO / "inventory/production/group_vars/dflash_containers/provision.yml").read_text()
    assert "default='') | trim }}" in (REPO / "roles/dflash_provision/defaults/main.yml").read_text()
