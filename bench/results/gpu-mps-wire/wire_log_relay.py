#!/usr/bin/env python3
"""Evidence tool (issue 23): a byte-logging relay in front of an MPS control daemon's `control` socket.

    wire_log_relay.py REAL_PIPE_DIR RELAY_PIPE_DIR LOG.jsonl

Listens on RELAY_PIPE_DIR/control, connects each accepted connection to REAL_PIPE_DIR/control,
passes bytes both ways with their ancillary data (the peer's SCM_CREDENTIALS, as root may send
them, and SCM_RIGHTS descriptors), and logs each message: connection, direction, length, the
ancillary data's kinds and the peer's credentials, the first 512 bytes in hex. Stdlib only.
"""
import json, os, socket, struct, sys, threading, time

real, relay, log_path = sys.argv[1:4]
lock = threading.Lock()
log = open(log_path, "a", buffering=1)


def note(**row):
    row["t"] = round(time.time(), 4)
    with lock:
        log.write(json.dumps(row) + "\n")


def kind_of(path):
    for kind, name in ((socket.SOCK_STREAM, "stream"), (socket.SOCK_SEQPACKET, "seqpacket"), (socket.SOCK_DGRAM, "dgram")):
        s = socket.socket(socket.AF_UNIX, kind)
        try:
            s.connect(path)
            s.close()
            return kind, name
        except OSError as e:
            note(probe=name, error=str(e))
        finally:
            s.close()
    raise SystemExit(f"cannot connect to {path}")


KIND, KIND_NAME = kind_of(f"{real}/control")
note(event="socket-type", kind=KIND_NAME)
CMSG = socket.CMSG_SPACE(struct.calcsize("3i")) + socket.CMSG_SPACE(64 * 4)


def pump(conn_id, direction, src, dst):
    try:
        while True:
            data, anc, flags, _ = src.recvmsg(65536, CMSG)
            out, kinds, fds = [], [], []
            for level, typ, cdata in anc:
                if level == socket.SOL_SOCKET and typ == socket.SCM_CREDENTIALS:
                    kinds.append({"creds": struct.unpack("3i", cdata[:12])})
                    out.append((level, typ, cdata[:12]))
                elif level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                    got = list(struct.unpack(f"{len(cdata) // 4}i", cdata[: len(cdata) // 4 * 4]))
                    targets = [os.readlink(f"/proc/self/fd/{fd}") for fd in got]
                    kinds.append({"fds": targets})
                    fds += got
                    out.append((level, typ, cdata))
                else:
                    kinds.append({"level": level, "type": typ})
            note(conn=conn_id, dir=direction, len=len(data), anc=kinds, flags=flags, hex=data[:512].hex(),
                 text=data[:200].decode("latin-1"))
            if not data and not anc:
                note(conn=conn_id, dir=direction, event="eof")
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            try:
                dst.sendmsg([data], out)
            except OSError as e:
                note(conn=conn_id, dir=direction, event="send-error", error=str(e))
                dst.sendmsg([data], [c for c in out if c[1] != socket.SCM_CREDENTIALS])
            for fd in fds:
                os.close(fd)
    except OSError as e:
        note(conn=conn_id, dir=direction, event="error", error=str(e))


os.makedirs(relay, exist_ok=True)
path = f"{relay}/control"
if os.path.exists(path):
    os.unlink(path)
server = socket.socket(socket.AF_UNIX, KIND)
server.bind(path)
os.chmod(path, 0o666)
server.listen(64)
note(event="listening", path=path)
n = 0
while True:
    client, _ = server.accept()
    n += 1
    pid, uid, gid = struct.unpack("3i", client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        exe = cmd = "?"
    client.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    upstream = socket.socket(socket.AF_UNIX, KIND)
    upstream.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    upstream.connect(f"{real}/control")
    note(conn=n, event="accept", peer={"pid": pid, "uid": uid, "gid": gid, "exe": exe, "cmd": cmd})
    threading.Thread(target=pump, args=(n, "c2d", client, upstream), daemon=True).start()
    threading.Thread(target=pump, args=(n, "d2c", upstream, client), daemon=True).start()
