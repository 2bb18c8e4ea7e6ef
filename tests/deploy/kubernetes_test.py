"""The Kubernetes example parses and holds together: a ConfigMap whose TOML the real moesnapd
accepts, a DaemonSet that shares the host's /dev/shm and /run/moesnap, takes its node id from the
downward API (the command's shell turns gpu-node-17 into --node-id 17), and probes the port the
config serves /healthz and /readyz on."""
import os
import stat
import subprocess
import sys
import tempfile

import yaml

source_dir, moesnapd = sys.argv[1], sys.argv[2]
with open(os.path.join(source_dir, "deploy/kubernetes/moesnapd.yaml")) as f:
    documents = {doc["kind"]: doc for doc in yaml.safe_load_all(f)}
assert set(documents) == {"ConfigMap", "DaemonSet"}, documents.keys()

config_text = documents["ConfigMap"]["data"]["moesnapd.toml"]
pod = documents["DaemonSet"]["spec"]["template"]["spec"]
(container,) = pod["containers"]
volumes = {volume["name"]: volume for volume in pod["volumes"]}
mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}

with tempfile.TemporaryDirectory() as work:
    config = os.path.join(work, "moesnapd.toml")
    with open(config, "w") as f:
        f.write(config_text)
    check = subprocess.run([moesnapd, "--config", config, "--node-id", "17", "--check-config"],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr

    # The container's command, with a stand-in moesnapd that prints what it was given.
    fake = os.path.join(work, "moesnapd")
    with open(fake, "w") as f:
        f.write('#!/bin/sh\necho "$@"\n')
    os.chmod(fake, stat.S_IRWXU)
    command = [part.replace("/usr/local/bin/moesnapd", fake) for part in container["command"]]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    run = subprocess.run(command, env={"NODE_NAME": "gpu-node-17", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["--config", "/etc/moesnap/moesnapd.toml", "--node-id", "17"], run.stdout

# The pool and the sockets live on the host, so they outlive the pod.
assert pod.get("hostIPC") or volumes[mounts["/dev/shm"]]["hostPath"]["path"] == "/dev/shm"
assert volumes[mounts["/run/moesnap"]]["hostPath"]["path"] == "/run/moesnap"
assert volumes[mounts["/etc/moesnap"]]["configMap"]["name"] == documents["ConfigMap"]["metadata"]["name"]
for line in config_text.splitlines():
    if line.startswith("socket = "):
        assert line.split('"')[1].startswith("/run/moesnap/"), line

# The probes and the scrape annotation name the port [http] address serves.
address = next(l.split('"')[1] for l in config_text.splitlines() if l.startswith("address = "))
port = int(address.rsplit(":", 1)[1])
assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
annotations = documents["DaemonSet"]["spec"]["template"]["metadata"]["annotations"]
assert annotations["prometheus.io/port"] == str(port)
print("kubernetes example: 1 passed, 0 failed")
