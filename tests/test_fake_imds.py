"""The rehearsal's fake IMDS answers the health watcher as EC2's IMDSv2 does (no engine needed)."""
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from localswarm.fake_imds import notice_file

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def imds(tmp_path):
    port_file = tmp_path / "port"
    server = subprocess.Popen([sys.executable, "-m", "localswarm.fake_imds", "--root", str(tmp_path),
                               "--port-file", str(port_file)], cwd=REPO)
    try:
        for _ in range(200):
            if port_file.exists():
                break
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text().strip()}", tmp_path
    finally:
        server.terminate()
        server.wait(10)


def ask(method, url, headers):
    request = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def test_tokens_notices_and_their_absence(imds):
    url, root = imds
    status, token = ask("PUT", f"{url}/node-2/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    assert status == 200 and token
    path = f"{url}/node-2/latest/meta-data/spot/instance-action"
    assert ask("GET", path, {})[0] == 401  # IMDSv2: no token, no answer
    assert ask("GET", path, {"X-aws-ec2-metadata-token": token})[0] == 404  # nothing announced
    notice = notice_file(root, "node-2")
    notice.parent.mkdir(parents=True)
    notice.write_text('{"action": "terminate", "time": "2026-11-23T02:00:00Z"}')
    assert ask("GET", path, {"X-aws-ec2-metadata-token": token}) == (200, notice.read_text())
    other = f"{url}/node-3/latest/meta-data/spot/instance-action"
    assert ask("GET", other, {"X-aws-ec2-metadata-token": token})[0] == 404  # each node its own notices
    assert ask("GET", f"{url}/../latest/meta-data/spot/instance-action", {"X-aws-ec2-metadata-token": token})[0] == 404


def test_the_watcher_reads_a_reclaim_from_it(imds, tmp_path):
    url, root = imds
    uuid = "GPU-00000001-1111-2222-3333-000000000001"
    inventory = tmp_path / "gpus.json"
    inventory.write_text(json.dumps([{"index": 0, "uuid": uuid, "name": "Simulated", "memory_mib": 1, "mig": False}]))
    daemon = tmp_path / "daemon.json"
    daemon.write_text(json.dumps({"node-generic-resources": [f"NVIDIA-GPU={uuid}"]}))
    notice = notice_file(root, "node-2")
    notice.parent.mkdir(parents=True)
    notice.write_text('{"action": "terminate", "time": "2026-11-23T02:00:00Z"}')
    done = subprocess.run([sys.executable, str(REPO / "node" / "gpu_health.py"), "--once", "--json", "--spot",
                           "--imds", f"{url}/node-2", "--inventory", str(inventory), "--daemon-json", str(daemon),
                           "--state-file", str(tmp_path / "state.json"), "--dockerd-pidfile", str(tmp_path / "no.pid")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["condition"] == "reclaim" and report["reason"] == "spot_terminate_at_2026-11-23T02:00:00Z"


def test_an_instance_gets_its_own_notices_and_a_new_instance_at_its_address_none(tmp_path):
    """The machines' IMDS (make_instance_handler) answers the notice paths from the files that `localswarm
    node spot-notice` and `maintenance-notice` write for an address; 404 when none is, as EC2 answers."""
    import threading
    from http.server import ThreadingHTTPServer

    from localswarm import fake_imds
    records = tmp_path / "records"
    fake_imds.register(records, "127.0.0.1", {"instance-id": "i-0abc", "metadataOptions": {"httpTokens": "required"},
                                              "instance-life-cycle": "spot"})
    assert fake_imds.instance_record(records, "127.0.0.1")["instance-life-cycle"] == "spot"
    assert fake_imds.instance_record(records, "127.0.0.2") == {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), fake_imds.make_instance_handler(records))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        token = ask("PUT", f"{url}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"})[1]
        spot, scheduled = f"{url}/latest/meta-data/spot/instance-action", f"{url}/latest/meta-data/events/maintenance/scheduled"
        assert ask("GET", spot, {})[0] == 401  # httpTokens required: no token, no answer
        # The purchasing option the watcher asks (EC2 User Guide, "Instance metadata categories").
        assert ask("GET", f"{url}/latest/meta-data/instance-life-cycle", {"X-aws-ec2-metadata-token": token}) == (
            200, "spot")
        assert ask("GET", spot, {"X-aws-ec2-metadata-token": token})[0] == 404  # nothing announced
        notice = fake_imds.spot_action("stop")
        file = fake_imds.instance_notice_file(records, "127.0.0.1")
        file.parent.mkdir(parents=True)
        file.write_text(json.dumps(notice))
        status, body = ask("GET", spot, {"X-aws-ec2-metadata-token": token})
        assert status == 200 and json.loads(body) == notice and notice["action"] == "stop"
        assert ask("GET", scheduled, {"X-aws-ec2-metadata-token": token})[0] == 404  # each notice its own file
        assert fake_imds.instance_notice_file(records, "192.168.216.9").parent != file.parent  # each address its own
        fake_imds.register(records, "127.0.0.1", {"instance-id": "i-0abc", "iam": {}})  # the same one, again
        assert ask("GET", spot, {"X-aws-ec2-metadata-token": token})[0] == 200
        fake_imds.unregister(records, "127.0.0.1")  # the instance is gone: so are its notices
        assert not file.exists()
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(notice))  # left behind, as a `down` without an unregister left it
        fake_imds.register(records, "127.0.0.1", {"instance-id": "i-0def", "metadataOptions": {}})
        assert not file.exists()  # a new instance at the address: no notice of the old one
    finally:
        server.shutdown()
