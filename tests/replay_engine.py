"""A ``cmd:`` engine that answers ``hello`` properly and then every request with what ``$G4H_REPLAY`` says (issue 37,
item 5: the protocol campaign of tests/test_hostile_campaign.py). ``$G4H_REPLAY`` is JSON: ``{"action": ...,
"reply": base64}``; the actions: ``write`` (the reply's bytes as they are, ``{id}`` replaced by the request's id),
``close`` (close stdout, keep running), ``exit`` (exit 3 after a stderr line), ``silence`` (never answer)."""

from __future__ import annotations

import base64
import json
import os
import sys
import time


def main() -> None:
    spec = json.loads(os.environ["G4H_REPLAY"])
    out = sys.stdout.buffer
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "hello":
            out.write(json.dumps({"id": req["id"], "ok": True, "protocol": 1, "ops": ["generate"], "vocab_size": 32,
                                  "engine": "replay"}).encode() + b"\n")
            out.flush()
            continue
        action = spec["action"]
        if action == "close":
            out.close()
            time.sleep(600)
        if action == "exit":
            sys.stderr.write("replay: exiting as told\n")
            sys.exit(3)
        if action == "silence":
            time.sleep(600)
        out.write(base64.b64decode(spec["reply"]).replace(b"{id}", str(req["id"]).encode()))
        out.flush()


if __name__ == "__main__":
    main()
