"""tsubame's control socket: JSON lines, one request and one reply."""
import json
import socket


def control_request(path, request, timeout_s=5):
    """One request on tsubame's JSON-lines control socket -> the reply object."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        s.sendall(json.dumps(request).encode() + b"\n")
        return json.loads(s.makefile("rb").readline())
