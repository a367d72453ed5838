"""tsubame's control socket in its own form: JSON lines, one request and one reply
(the server's first line, QMP's greeting, is skipped)."""
import json
import socket


def control_request(path, request, timeout_s=5):
    """One request on tsubame's JSON-lines control socket -> the reply object."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        s.sendall(json.dumps(request).encode() + b"\n")
        reader = s.makefile("rb")
        while True:
            line = reader.readline()
            if not line.startswith(b'{"QMP"'):
                return json.loads(line)
