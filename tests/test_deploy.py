"""Deployment across machines, played out on loopback with real Flower processes.

One ``flower-superlink`` with TLS and ``--enable-supernode-auth``, SuperNodes registered with
``flwr supernode register`` and started with their own key and ``--node-config``, the run
submitted with ``flwr run . <connection>`` and judged by ``flwr ls --format json``: the commands
of docs/DEPLOY.md, driven through scripts/deploy/local_cluster.py (which the tests thereby cover).
Only 127.0.0.1 is used; every wait is bounded, and every process is stopped (also on failure).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# The module fixture starts a cluster and runs it in the first test's setup: allow for all of it.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "scripts" / "deploy"
ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
}
RUN = "num_clients=2 num_rounds=2 min_train_nodes=2 fraction_train=1.0 local_steps=5 output_dir={out}"
SUPERNODE_CONNECTION_ERROR = "Exit Code: 305"  # logged by Flower; the process itself exits 1


def _load_local_cluster():
    spec = importlib.util.spec_from_file_location("fedact_local_cluster", DEPLOY / "local_cluster.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


lc = _load_local_cluster()


def _script(name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(DEPLOY / name), *args], capture_output=True, text=True,
                          timeout=60, check=False, env=env)


def _wait_exit(proc, timeout: float) -> int | None:
    """Exit code of a process started by local_cluster, or None if still running at ``timeout``."""
    popen = lc._POPENS[proc.pid]
    try:
        return popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _https_get(url: str, cafile: Path) -> int:
    with urllib.request.urlopen(url, timeout=5, context=ssl.create_default_context(cafile=str(cafile))) as r:
        return r.status


# --------------------------------------------------------------------------------------------
# The scripts that make certificates and keys (no Flower process)
# --------------------------------------------------------------------------------------------
def test_make_certs_writes_a_ca_and_a_superlink_certificate_for_the_given_names(tmp_path):
    out = tmp_path / "certs"
    proc = _script("make_certs.sh", "-o", str(out), "-n", "link.example.org", "-i", "10.0.0.5", "-d", "30")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".key", ".crt", ".pem")) == [
        "ca.crt", "ca.key", "server.key", "server.pem"]
    verify = subprocess.run(["openssl", "verify", "-CAfile", out / "ca.crt", out / "server.pem"],
                            capture_output=True, text=True, timeout=30, check=False)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    san = subprocess.run(["openssl", "x509", "-in", out / "server.pem", "-noout", "-ext", "subjectAltName"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    for name in ("DNS:localhost", "IP Address:127.0.0.1", "DNS:link.example.org", "IP Address:10.0.0.5"):
        assert name in san
    for key in ("ca.key", "server.key"):  # secrets: owner only
        assert (out / key).stat().st_mode & 0o077 == 0
    again = _script("make_certs.sh", "-o", str(out))
    assert again.returncode != 0 and "exists" in again.stderr  # never overwrites silently
    assert _script("make_certs.sh", "-o", str(out), "-f").returncode == 0
    bad = _script("make_certs.sh", "-o", str(tmp_path / "x"), "-i", "not-an-ip")
    assert bad.returncode == 2 and "not an IP address" in bad.stderr
    assert "-n NAME" in _script("make_certs.sh", "-h").stdout


@pytest.mark.parametrize("with_ssh_keygen", [True, False], ids=["ssh-keygen", "python-fallback"])
def test_make_node_keys_writes_key_pairs_flower_accepts(tmp_path, with_ssh_keygen):
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.cli.supernode.register import try_load_public_key

    env = dict(os.environ)
    if not with_ssh_keygen:  # a PATH with only what the script needs, ssh-keygen left out
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for tool in ("bash", "mkdir", "chmod", "rm", "sed"):
            (bin_dir / tool).symlink_to(shutil.which(tool))
        (bin_dir / "python3").symlink_to(sys.executable)
        env["PATH"] = str(bin_dir)
    elif shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen not installed")
    out = tmp_path / "keys"
    proc = _script("make_node_keys.sh", "-o", str(out), "site-a", "site-b", env=env)
    assert proc.returncode == 0, proc.stderr
    publics = set()
    for name in ("site-a", "site-b"):
        private = load_ssh_private_key((out / name).read_bytes(), None)  # what flower-supernode does
        assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
        assert (out / name).stat().st_mode & 0o077 == 0
        publics.add(try_load_public_key(out / f"{name}.pub"))  # what `flwr supernode register` does
    assert len(publics) == 2
    assert _script("make_node_keys.sh", "-o", str(out), "site-a", env=env).returncode == 1  # exists
    assert _script("make_node_keys.sh", "-o", str(out), "../evil", env=env).returncode == 2


def _flower_flags(command: str) -> set[str]:
    """The option strings ``flower-superlink`` / ``flower-supernode`` accept."""
    try:
        if command == "flower-superlink":
            from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink as parser
        else:
            from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode as parser
        return set(parser()._option_string_actions)
    except (ImportError, AttributeError):  # private helpers moved: ask the command itself
        text = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=60,
                              check=False, env={**os.environ, **ENV}).stdout
        return set(re.findall(r"--[a-z][a-z-]*[a-z]", text))


def _fab_files(app: Path) -> set[str]:
    """The files of the FAB that ``flwr run`` builds from ``app`` (Flower's own builder)."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    return set(zipfile.ZipFile(io.BytesIO(build_fab_from_disk(app))).namelist())


def test_fab_carries_the_package_and_its_configs_and_nothing_else():
    """The FAB that ``flwr run .`` builds (pyproject.toml's ``fab-include``): every module of the
    package and every Hydra config, and no scripts, docs or tests, which a SuperNode would unpack
    and hash again for every message."""
    names = _fab_files(ROOT)
    assert {name.split("/")[0] for name in names} == {"fedact_app", "conf", "pyproject.toml", ".info"}
    needed = {str(path.relative_to(ROOT)) for folder, pattern in (("fedact_app", "*.py"), ("conf", "*.yaml"))
              for path in (ROOT / folder).rglob(pattern) if "__pycache__" not in path.parts}
    assert "fedact_app/client_app.py" in needed and "conf/config.yaml" in needed
    assert needed <= names, f"missing from the FAB: {sorted(needed - names)}"


def test_an_app_folder_with_its_own_clientapp_ships_that_module_and_the_configs(tmp_path):
    """scripts/attack.py's ``app_with_client`` (the attack and forged-reply runs): its FAB holds
    its ClientApp module and conf/, under pyproject.toml's own ``fab-include`` rewritten for it."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from attack import app_with_client

    folder = app_with_client(tmp_path / "app", "own_client", "from fedact_app.client_app import app\n")
    names = _fab_files(folder)
    assert {"own_client.py", "conf/config.yaml"} <= names
    assert 'clientapp = "own_client:app"' in (folder / "pyproject.toml").read_text()


def test_deploy_guide_uses_only_flags_flower_has():
    doc = (ROOT / "docs" / "DEPLOY.md").read_text()
    commands = {"flower-superlink": set(), "flower-supernode": set()}
    for block in re.findall(r"```bash\n(.*?)```", doc, re.S):
        for command in re.split(r"\n(?=\S)", block.replace("\\\n", " ")):  # one per logical line
            for name, flags in commands.items():
                if re.search(rf"(^|\s){name}\s", command):
                    flags.update(re.findall(r"\s(--[a-z][a-z-]*)", command))
    assert commands["flower-superlink"] >= {"--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile",
                                            "--enable-supernode-auth", "--disable-runtime-dependency-installation"}
    assert commands["flower-supernode"] >= {"--root-certificates", "--auth-supernode-private-key",
                                            "--node-config", "--superlink"}
    for name, flags in commands.items():
        assert flags <= _flower_flags(name), f"{name}: unknown {sorted(flags - _flower_flags(name))}"


def _prefix_covered(path: str, prefixes: list[str]) -> bool:
    return any(path.startswith(prefix) for prefix in prefixes)


def test_deploy_guide_proxy_forwards_the_fleet_api_and_nothing_else():
    """The nginx block of docs/DEPLOY.md (step 2b) forwards every path the installed Flower's
    SuperNode calls, none of the SuperLink's Control and Runtime routes, and refuses the rest."""
    import inspect

    from flwr.supercore.routers.runtime.responses import router as responses
    from flwr.supercore.routers.runtime.router import router as runtime
    from flwr.superlink.routers.control.router import router as control
    from flwr.superlink.routers.fleet.router import router as fleet
    from flwr.supernode import fleet_http_client

    (block,) = re.findall(r"```nginx\n(.*?)```", (ROOT / "docs" / "DEPLOY.md").read_text(), re.S)
    locations = re.findall(r"location\s+(\S+)\s*\{([^}]*)\}", block)
    forwarded = [prefix for prefix, body in locations if "proxy_pass" in body]
    assert forwarded and ("/", " return 403; ") in locations
    node_paths = re.findall(r'path="(/[^"]+)"', inspect.getsource(fleet_http_client))
    assert node_paths and all(_prefix_covered(p, forwarded) for p in node_paths), (node_paths, forwarded)
    assert all(_prefix_covered(r.path, forwarded) for r in fleet.routes)
    private = [r.path for router in (control, runtime, responses) for r in router.routes]
    assert private and [p for p in private if _prefix_covered(p, forwarded)] == []


def test_config_toml_example_is_a_valid_flwr_config(tmp_path):
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")

    example = ROOT / "deploy" / "config.toml.example"
    config = tomllib.loads(example.read_text())
    connections = {k: v for k, v in config["superlink"].items() if isinstance(v, dict)}
    assert config["superlink"]["default"] in connections
    for name, conn in connections.items():
        if conn["address"] != ":local:":  # every remote connection: TLS with an absolute CA path
            assert "insecure" not in conn and Path(conn["root-certificates"]).is_absolute(), name
            assert not conn["address"].startswith(("http://", "https://")), name
    shutil.copy(example, tmp_path / "config.toml")
    listed = subprocess.run(["flwr", "config", "list", "--format", "json"], capture_output=True, text=True,
                            timeout=60, check=False, env={**os.environ, **ENV, "FLWR_HOME": str(tmp_path)})
    payload = json.loads(listed.stdout[listed.stdout.find("{"):])
    assert sorted(payload["superlink"]) == sorted(connections), listed.stdout + listed.stderr
    assert (tmp_path / "config.toml").read_text() == example.read_text()  # flwr left it as it is


def test_local_cluster_cli_without_a_cluster(tmp_path, capsys):
    assert lc.main(["status", "--dir", str(tmp_path)]) == 3
    assert lc.main(["down", "--dir", str(tmp_path)]) == 0
    assert "no cluster recorded" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# A TLS + authenticated deployment: 2 registered SuperNodes, 1 unregistered intruder, 2 runs
# --------------------------------------------------------------------------------------------
@dataclass
class Deployment:
    cluster: object
    out: Path
    run_id: str = ""
    state: str = ""
    details: str = ""
    log: str = ""
    runs: list = field(default_factory=list)
    nodes: list = field(default_factory=list)
    intruder_rc: int | None = None
    intruder_log: str = ""
    mismatch_state: str = ""
    mismatch_log: str = ""
    status: dict = field(default_factory=dict)
    plain_http_error: str = ""
    wrong_ca_error: str = ""
    wrong_ca_cli: dict = field(default_factory=dict)  # `flwr supernode ls` trusting another CA
    wrong_ca_supernode: str = ""  # output of a SuperNode trusting another CA
    ss_listening: str = ""  # `ss -Hltnp`, taken with `status`
    ca_only_register: dict = field(default_factory=dict)  # register with nothing but ca.crt
    pids: list = field(default_factory=list)
    seconds: dict = field(default_factory=dict)  # wall time of each phase, for the curious


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    base = tmp_path_factory.mktemp("deploy")
    env = {**ENV, "FLWR_HOME": str(base / "unused-flwr-home")}  # never the user's ~/.flwr
    dep = Deployment(cluster=None, out=base / "outputs")
    intruder = wrong_ca_node = None
    t0 = time.monotonic()
    try:
        dep.cluster = cluster = lc.up(base / "cluster", nodes=2, env=env, cwd=base, timeout=100, quiet=True)

        # TLS only: plain HTTP and a certificate from another CA are both refused.
        other = base / "other-ca"
        assert _script("make_certs.sh", "-o", str(other)).returncode == 0
        for attr, url, ca in (("plain_http_error", f"http://127.0.0.1:{cluster.port}/health", None),
                              ("wrong_ca_error", f"https://127.0.0.1:{cluster.port}/health", other / "ca.crt")):
            try:
                if ca is None:
                    urllib.request.urlopen(url, timeout=5).close()  # noqa: S310 - loopback
                else:
                    _https_get(url, ca)
                setattr(dep, attr, "")
            except (urllib.error.URLError, OSError, ssl.SSLError) as err:
                setattr(dep, attr, f"{type(err).__name__}: {err}")
        # What `flwr` and a SuperNode print when they trust another CA (docs/DEPLOY.md's table).
        lc._write_connection(base / "wrong-ca-home", cluster.port, other / "ca.crt")
        wrong = lc.run_flwr(base / "wrong-ca-home", ["supernode", "ls", lc.CONNECTION, "--format", "json"],
                         timeout=60, env=env)
        dep.wrong_ca_cli = {**lc.json_payload(wrong.stdout), "rc": wrong.returncode}
        cmd = list(cluster.nodes[0].cmd)
        cmd[cmd.index("--root-certificates") + 1] = str(other / "ca.crt")
        cmd[cmd.index("--port") + 1] = str(port := lc.free_port(lc.HOST))
        (base / "wrong-ca-node").mkdir()
        wrong_ca_node = lc._spawn("wrong-ca-node", cmd, base / "wrong-ca-node.log", port,
                                  {**os.environ, **env, "FLWR_HOME": str(base / "wrong-ca-node")},
                                  base / "wrong-ca-node")
        _wait_exit(wrong_ca_node, timeout=60)
        dep.wrong_ca_supernode = lc.tail(wrong_ca_node.log, 60)

        dep.seconds["up"] = time.monotonic() - t0
        dep.run_id = lc.submit(cluster, ROOT, overrides=RUN.format(out=dep.out))

        # While the run goes on: a SuperNode with a key nobody registered tries to join.
        assert _script("make_node_keys.sh", "-o", str(base / "intruder-keys"), "intruder").returncode == 0
        (base / "intruder").mkdir()
        intruder = lc.start_supernode(cluster, "intruder", base / "intruder-keys" / "intruder",
                                      "partition-id=0 num-partitions=2",
                                      {**os.environ, **env, "FLWR_HOME": str(base / "intruder")},
                                      base / "intruder")
        dep.intruder_rc = _wait_exit(intruder, timeout=60)
        dep.intruder_log = lc.tail(intruder.log, 60)
        dep.seconds["intruder refused"] = time.monotonic() - t0

        dep.state, dep.details, dep.log = lc.wait_run(cluster, dep.run_id, timeout=300)
        dep.runs = lc.list_runs(cluster, dep.run_id)
        dep.nodes = lc.list_nodes(cluster)
        dep.seconds["run finished"] = time.monotonic() - t0

        # A run whose num_clients does not match the nodes' num-partitions: the reason is in its log.
        bad_id = lc.submit(cluster, ROOT, overrides=RUN.format(out=dep.out / "mismatch")
                           .replace("num_clients=2", "num_clients=3").replace("num_rounds=2", "num_rounds=1"))
        dep.mismatch_state, _, dep.mismatch_log = lc.wait_run(cluster, bad_id, timeout=120)
        dep.seconds["mismatch run finished"] = time.monotonic() - t0
        status = subprocess.run([sys.executable, str(DEPLOY / "local_cluster.py"), "status", "--dir",
                                 cluster.dir, "--json"], capture_output=True, text=True, timeout=60,
                                check=False, env={**os.environ, **env})
        dep.status = {**json.loads(status.stdout or "{}"), "rc": status.returncode,
                      "stderr": status.stderr[-3000:]}  # shown when the status check fails
        if shutil.which("ss"):
            dep.ss_listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True,
                                              timeout=30, check=False).stdout

        # Whoever reaches the SuperLink's port with the public ca.crt (no key, no account)
        # registers a SuperNode key: the Control API shares the port with the Fleet API.
        lc._write_connection(base / "ca-only-home", cluster.port, cluster.root / "certs" / "ca.crt")
        assert _script("make_node_keys.sh", "-o", str(base / "outsider-keys"), "outsider").returncode == 0
        outsider = lc.run_flwr(base / "ca-only-home", ["supernode", "register",
                            str(base / "outsider-keys" / "outsider.pub"), lc.CONNECTION, "--format", "json"],
                            timeout=60, env=env)
        dep.ca_only_register = {**lc.json_payload(outsider.stdout), "rc": outsider.returncode}
        if dep.ca_only_register.get("node-id") is not None:
            cluster.cli("supernode", "unregister", str(dep.ca_only_register["node-id"]), cluster.connection)
        print(f"\ndeployment phases (s since start): { {k: round(v, 1) for k, v in dep.seconds.items()} }")
        yield dep
    finally:
        for stray in (intruder, wrong_ca_node):
            if stray is not None and stray.alive():
                lc._killpg(stray.pid, 9)
        if dep.cluster is not None:
            dep.pids = lc.down(dep.cluster, quiet=True)


def test_run_on_two_authenticated_supernodes_completes(deployment):
    dep = deployment
    assert dep.state == "finished:completed", f"{dep.state} {dep.details}\n{dep.log[-4000:]}"
    assert [r["status"] for r in dep.runs] == ["finished:completed"]  # `flwr ls --format json`
    assert "round 2/2" in dep.log


def test_global_model_changed_and_both_nodes_trained(deployment):
    (folder,) = [p for p in deployment.out.iterdir() if p.is_dir() and p.name != "mismatch"]
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all(r["clients"] == 2 and r["rejected"] == 0 for r in rows[1:])
    assert rows[-1]["test_loss"] != rows[0]["test_loss"]  # the global model moved
    assert rows[-1]["train_loss"] == rows[-1]["train_loss"]  # not NaN
    import numpy as np
    from safetensors.numpy import load_file

    final = load_file(str(folder / "model.safetensors"))
    assert final and all(np.isfinite(a).all() for a in final.values())


def test_supernodes_have_their_own_partitions_and_are_online(deployment):
    cluster = deployment.cluster
    assert [n.node_config for n in cluster.nodes] == ["partition-id=0 num-partitions=2",
                                                      "partition-id=1 num-partitions=2"]
    statuses = {n["node-id"]: n["status"] for n in deployment.nodes}
    assert statuses == {n.node_id: "online" for n in cluster.nodes}
    for node in cluster.nodes:  # each ran the ClientApp for the run
        assert "Start `flwr-clientapp` process" in lc.tail(node.log, 400)


def test_unregistered_supernode_is_refused_and_never_listed(deployment):
    dep = deployment
    assert dep.intruder_rc not in (None, 0), dep.intruder_log  # it exited by itself, with an error
    assert SUPERNODE_CONNECTION_ERROR in dep.intruder_log and "Failed to activate SuperNode" in dep.intruder_log
    superlink_log = lc.tail(dep.cluster.superlink.log, 2000)
    assert "No SuperNode found with the given public key" in superlink_log
    assert len(dep.nodes) == 2  # only the two registered nodes, the intruder never appears
    assert {n["node-id"] for n in dep.nodes} == {n.node_id for n in dep.cluster.nodes}


def test_superlink_refuses_plain_http_and_foreign_certificates(deployment):
    assert deployment.plain_http_error, "the SuperLink answered plain HTTP"
    assert "CERTIFICATE_VERIFY_FAILED" in deployment.wrong_ca_error or "certificate" in \
        deployment.wrong_ca_error.lower(), deployment.wrong_ca_error


def test_every_process_listens_only_on_its_own_loopback_port(deployment):
    """The SuperLink's one socket carries its Control, Fleet and Runtime APIs: it is bound to
    127.0.0.1 and there is no other (`local_cluster.py status`, cross-checked with `ss`)."""
    dep = deployment
    procs = dep.status["processes"]
    assert {p["name"]: p["listening"] for p in procs} == \
        {p["name"]: [f"127.0.0.1:{p['port']}"] for p in procs}, dep.status
    assert procs[0]["name"] == "superlink" and procs[0]["port"] == dep.cluster.port
    if dep.ss_listening:  # the kernel's view, independent of local_cluster's reading of /proc
        link = [line.split()[3] for line in dep.ss_listening.splitlines()
                if f"pid={dep.cluster.superlink.pid}," in line]
        assert link == [f"127.0.0.1:{dep.cluster.port}"], dep.ss_listening


def test_control_api_is_on_the_fleet_port_and_open_to_anyone_with_the_ca_certificate(deployment):
    """Flower 1.41 OSS, pinned so that docs/DEPLOY.md's Security section is revisited when it
    changes: `flwr supernode register` with nothing but the public ca.crt, on the port the
    SuperNodes use, succeeds. Only the bind address (and a proxy or firewall) keeps it private."""
    dep = deployment
    assert {n.cmd[n.cmd.index("--superlink") + 1] for n in dep.cluster.nodes} == \
        {f"127.0.0.1:{dep.cluster.port}"}
    assert dep.ca_only_register.get("success") is True, dep.ca_only_register


def test_up_refuses_a_superlink_listening_anywhere_else(tmp_path, monkeypatch):
    """A second listener (e.g. an older Flower's gRPC Control API on 0.0.0.0:9093) stops `up`,
    and what it started is stopped."""
    real = lc.listening
    monkeypatch.setattr(lc, "listening", lambda pids: sorted([*real(pids), "0.0.0.0:9093"]))
    env = {**ENV, "FLWR_HOME": str(tmp_path / "unused-flwr-home")}
    with pytest.raises(lc.ClusterError, match=r"superlink .* listens on .*0\.0\.0\.0:9093") as err:
        lc.up(tmp_path / "cluster", nodes=1, env=env, cwd=tmp_path, timeout=60, quiet=True)
    pid = int(re.search(r"pid (\d+)", str(err.value)).group(1))
    assert lc.start_time(pid) is None  # stopped
    assert not (tmp_path / "cluster" / "cluster.json").exists()


def test_listening_reads_the_sockets_a_process_accepts_on():
    with socket.socket() as server, socket.socket() as bound_only:
        server.bind(("127.0.0.1", 0))
        bound_only.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()):
            found = lc.listening([os.getpid()])
        assert f"127.0.0.1:{server.getsockname()[1]}" in found
        assert f"127.0.0.1:{bound_only.getsockname()[1]}" not in found
    assert lc.listening([2**22 + 12345]) == []  # no such process


def test_troubleshooting_quotes_what_flwr_and_a_supernode_print_for_a_foreign_ca(deployment):
    dep = deployment
    table = (ROOT / "docs" / "DEPLOY.md").read_text().split("## Troubleshooting", 1)[1]
    assert dep.wrong_ca_cli.get("success") is False, dep.wrong_ca_cli
    first_sentence = dep.wrong_ca_cli["error-message"].strip().splitlines()[-1].split(". ")[0]
    assert "Connection to the SuperLink" in first_sentence, dep.wrong_ca_cli  # not the progress lines
    assert f"`flwr`: `{first_sentence}." in table
    assert "CERTIFICATE_VERIFY_FAILED] certificate verify failed" in dep.wrong_ca_supernode, \
        dep.wrong_ca_supernode[-3000:]
    assert "SSL/TLS handshake error detected." in dep.wrong_ca_supernode
    assert "SuperNode: `SSL/TLS handshake error detected.`" in table
    assert "`[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed`" in table


def test_node_config_mismatch_is_reported_in_the_run_log_and_fails_the_run(deployment):
    """Every node refuses the run (num-partitions != num_clients): its one round has no usable
    reply, fewer rounds than max_empty_rounds, and the run fails instead of ending completed."""
    dep = deployment
    assert dep.mismatch_state == "finished:failed", dep.mismatch_log[-3000:]
    assert "No usable client reply in any round (1..1)" in dep.mismatch_log, dep.mismatch_log[-3000:]
    assert "num-partitions=2" in dep.mismatch_log and "num_clients=3" in dep.mismatch_log, \
        dep.mismatch_log[-3000:]
    assert "--node-config \"partition-id=<i> num-partitions=3\"" in dep.mismatch_log  # the deployment fix


def test_cluster_status_and_down_stop_every_process(deployment):
    dep = deployment
    assert dep.status["rc"] == 0 and dep.status["healthy"], dep.status  # `local_cluster.py status`
    assert [p["name"] for p in dep.status["processes"]] == ["superlink", "node-0", "node-1"]
    assert sorted(n["status"] for n in dep.status["nodes"]) == ["online", "online"]
    assert [r["status"] for r in dep.status["runs"]].count("finished:completed") >= 1
    cluster = dep.cluster
    tree = {p.pid for p in cluster.procs}
    for proc in cluster.procs:
        tree |= lc.descendants(proc.pid)
    assert len(tree) >= 5  # SuperLink + its SuperExec, 2 SuperNodes + their SuperExecs
    lc.down(cluster, quiet=True)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(lc.start_time(pid) is not None for pid in tree):
        time.sleep(0.2)
    assert [pid for pid in tree if lc.start_time(pid) is not None] == []
    assert not (Path(cluster.dir) / "cluster.json").exists()
    assert (Path(cluster.dir) / "logs" / "superlink.log").stat().st_size > 0


# --------------------------------------------------------------------------------------------
# A SuperNode serving its own data (node-config data-path)
# --------------------------------------------------------------------------------------------
def _write_site(folder: Path, n_train: int, n_test: int, label: int, seed: int) -> None:
    """``<folder>/train.parquet`` and ``test.parquet``: 28x28 grayscale PNGs with one label, the
    layout of ``dataset.path`` (fedact_app/tasks/vision/splits.py) with the columns of dataset=fashion_mnist."""
    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    for split, n in (("train", n_train), ("test", n_test)):
        images = [Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8), mode="L") for _ in range(n)]
        datasets.Dataset.from_dict({"image": images, "label": [label] * n}, features=features) \
            .to_parquet(str(folder / f"{split}.parquet"))


def test_supernode_with_its_own_data_path_trains_on_it(tmp_path):
    sites = {0: (tmp_path / "site-a", 24), 1: (tmp_path / "site-b", 40)}
    for i, (folder, n_train) in sites.items():
        _write_site(folder, n_train, 8, label=3, seed=i)
    _write_site(tmp_path / "server", 8, 16, label=3, seed=7)  # the ServerApp's central test set
    env = {**ENV, "FLWR_HOME": str(tmp_path / "unused-flwr-home")}
    cluster = None
    try:
        cluster = lc.up(tmp_path / "cluster", nodes=2, env=env, cwd=tmp_path, timeout=150, quiet=True,
                        node_configs={i: f"data-path='{folder}'" for i, (folder, _) in sites.items()})
        overrides = (f"dataset=fashion_mnist dataset.path={tmp_path / 'server'} "
                     + RUN.format(out=tmp_path / "outputs"))
        run_id = lc.submit(cluster, ROOT, overrides=overrides)
        state, details, log = lc.wait_run(cluster, run_id, timeout=360)
        assert state == "finished:completed", f"{state} {details}\n{log[-4000:]}"
        assert "all train partition-id" not in log  # own-data nodes (each partition 0 of 1) share none
        for node, (folder, n_train) in zip(cluster.nodes, sites.values()):
            assert f"data-path={folder}, {n_train} training examples" in lc.tail(node.log, 400)
        (folder,) = list((tmp_path / "outputs").iterdir())
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert all(r["clients"] == 2 and r["rejected"] == 0 for r in rows[1:])
        assert rows[-1]["test_loss"] != rows[0]["test_loss"]
    finally:
        if cluster is not None:
            lc.down(cluster, quiet=True)


def test_bad_data_path_node_config_fails_clearly(tmp_path):
    from flwr.app import Context, RecordDict

    from fedact_app.client_work import node_data
    from fedact_app.config import compose

    files = compose("dataset=fashion_mnist")

    def node(config):
        return Context(run_id=1, node_id=1, node_config=config, state=RecordDict(), run_config={})

    assert node_data(node({"data-path": str(tmp_path)}), files) == (0, 1, str(tmp_path))
    assert node_data(node({"partition-id": 1, "num-partitions": 10}), compose("")) == (1, 10, None)
    for config, cfg, message in [
        ({"data-path": "relative/site"}, files, "must be an absolute path"),
        ({"data-path": str(tmp_path), "partition-id": 0}, files, "either"),
        ({"data-path": str(tmp_path)}, compose(""), "dataset=digits"),
        ({"data-path": str(tmp_path / "missing")}, files, "does not exist"),
    ]:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            node_data(node(config), cfg)


# ------------------------------------------------------------------ warm workers (fedact_app.node_worker)
# SCAFFOLD: each client's c_i lives in its Context.state, which goes to the worker and back.
# device=cpu: the runs are compared bit for bit, which holds on the CPU (a GPU's convolutions
# may add in another order from one process to the next).
WORKER_RUN = ("algorithm=scaffold num_clients=2 num_rounds=2 min_train_nodes=2 fraction_train=1.0 "
              "local_steps=3 batch_size=16 device=cpu output_dir={out}")


def _results(output: Path) -> tuple[list[dict], dict]:
    """A run's metrics.jsonl rows (wall-clock columns aside) and final model."""
    from safetensors.torch import load_file

    (folder,) = [p for p in output.iterdir() if (p / "summary.json").is_file()]
    rows = [{k: v for k, v in json.loads(line).items() if "seconds" not in k}
            for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return rows, load_file(str(folder / "model.safetensors"))


def _assert_same_run(a: tuple[list[dict], dict], b: tuple[list[dict], dict]) -> None:
    import torch

    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_warm_workers_give_the_cold_runs_results_and_a_restarted_supernode_gets_a_new_one(tmp_path, flower_engine):
    from conftest import ENGINE_CPUS

    from fedact_app.config import compose
    from fedact_app.node_worker.inventory import workers
    from fedact_app.tasks.vision.data import load_test

    # every ServerApp below reads the digits split from the data cache: one that computes it (cache
    # empty) evaluates the same final model to a test loss some 1e-7 away (measured on digits)
    load_test(compose(WORKER_RUN.format(out=tmp_path)))
    worker_dir = Path(tempfile.mkdtemp(prefix="fw-")) / "w"  # short: a socket path has at most 107 bytes
    # the simulation's clients have ENGINE_CPUS torch threads (Ray sets OMP_NUM_THREADS): so do the workers
    env = {**ENV, "FLWR_HOME": str(tmp_path / "unused-flwr-home"), "FEDACT_WORKER_DIR": str(worker_dir),
           "OMP_NUM_THREADS": str(ENGINE_CPUS)}
    results = {}
    try:
        for mode, template in (("warm", lc.DEFAULT_TEMPLATE), ("cold", lc.DEFAULT_TEMPLATE + " warm-worker=false")):
            cluster = lc.up(tmp_path / mode, nodes=2, env=env, cwd=tmp_path, timeout=150, quiet=True,
                            node_config_template=template)
            try:
                run_id = lc.submit(cluster, ROOT, overrides=WORKER_RUN.format(out=tmp_path / f"out-{mode}"))
                state, details, log = lc.wait_run(cluster, run_id, timeout=300)
                assert state == "finished:completed", f"{state} {details}\n{log[-4000:]}"
                results[mode] = _results(tmp_path / f"out-{mode}")
                served = [f"warm worker of run {run_id} node {n.node_id}" in lc.tail(n.log, 400)
                          for n in cluster.nodes]
                assert served == [mode == "warm"] * 2
                assert not workers(worker_dir)  # wait_run stopped the finished run's workers
                if mode == "warm":  # node-0's SuperNode restarts; the next run gets a worker of the new one
                    node = cluster.nodes[0]
                    lc._killpg(node.pid, signal.SIGTERM)
                    assert _wait_exit(node, 30) is not None
                    node_env = {**os.environ, **lc.flwr_cli.BASE_ENV, **env, "FLWR_HOME": str(cluster.root / node.name)}
                    fresh = lc.start_supernode(cluster, node.name, Path(node.key), node.node_config, node_env,
                                               Path(node.cwd))
                    fresh.node_id, cluster.nodes[0] = node.node_id, fresh
                    cluster.save()
                    again = lc.submit(cluster, ROOT, overrides=WORKER_RUN.format(out=tmp_path / "out-again"))
                    state, details, log = lc.wait_run(cluster, again, timeout=300)
                    assert state == "finished:completed", f"{state} {details}\n{log[-4000:]}"
                    assert f"warm worker of run {again} node {node.node_id}" in lc.tail(fresh.log, 400)
            finally:
                lc.down(cluster, quiet=True)
        assert not workers(worker_dir)
        _assert_same_run(results["warm"], results["cold"])
        simulated = flower_engine.run(ROOT, overrides=WORKER_RUN.format(out=tmp_path / "out-sim"), num_supernodes=2)
        assert simulated.completed, f"{simulated.status} {simulated.details}\n{simulated.tail(60)}"
        _assert_same_run(results["warm"], _results(tmp_path / "out-sim"))
    finally:
        shutil.rmtree(worker_dir.parent, ignore_errors=True)

