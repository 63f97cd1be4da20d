"""Throughput of the secure channel against plain TCP, between two processes on 127.0.0.1.

Each trial moves the same payload from this process to a receiver process, once over a plain
trio TCP stream (read with recv_into into a reused buffer: the fastest honest baseline) and
once over gossip's secure channel in each swarm cipher (Noise handshake, then 1 MiB records
sealed with AES-256-GCM, the default, or ChaCha20-Poly1305, decrypted with receive_into into a
reused buffer, as the state transfer does for fp32). ``secure_vs_plain`` is the default
cipher's; target (the issue on a faster exchange): at least 0.75.
Timing runs from the first byte sent to the receiver's one-byte acknowledgement that it holds
everything; the handshake is excluded. The modes alternate, and the median of the trials is
reported. Nothing here asserts on time.

Usage: python bench/channel.py [--mb 100] [--trials 9]
The last line printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import trio

from gossip.channel import MAX_RECORD
from gossip.endpoints import connect, serve
from gossip.handshake import CIPHERS, DEFAULT_CIPHER, Swarm
from gossip.identity import Identity
from gossip.network import TcpNetwork

CHUNK = MAX_RECORD
MODES = ("plain", *CIPHERS)
TARGET_SECURE_VS_PLAIN = 0.75


async def receiver(mode: str, total: int, swarm_key: bytes) -> None:
    """Child process: listen, print the address, receive ``total`` bytes per connection, ack."""
    net = TcpNetwork()

    async def plain(stream: trio.SocketStream) -> None:
        buf = memoryview(bytearray(CHUNK))
        got = 0
        while got < total:
            n = await stream.socket.recv_into(buf)
            if n == 0:
                return
            got += n
        await stream.send_all(b"\x01")

    async def secure(channel) -> None:
        buf = memoryview(bytearray(CHUNK))
        got = 0
        while got < total:
            got += await channel.receive_into(buf)
        await channel.send(b"\x01")

    async with trio.open_nursery() as nursery:
        if mode == "plain":
            address = await nursery.start(net.serve, "127.0.0.1:0", plain)
        else:
            swarm = Swarm("bench", swarm_key, mode)
            address = await nursery.start(
                lambda task_status: serve(net, "127.0.0.1:0", secure, identity=Identity.generate(),
                                          swarm=swarm, task_status=task_status)
            )
        print(address, flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)  # until the parent closes our stdin
        nursery.cancel_scope.cancel()


async def send_plain(address: str, payload: memoryview) -> float:
    stream = await TcpNetwork().dial(address)
    async with stream:
        start = time.perf_counter()
        for offset in range(0, len(payload), CHUNK):
            await stream.send_all(payload[offset : offset + CHUNK])
        assert await stream.receive_some(1) == b"\x01"
        return time.perf_counter() - start


async def send_secure(address: str, payload: memoryview, swarm: Swarm) -> float:
    channel = await connect(TcpNetwork(), address, identity=Identity.generate(), swarm=swarm)
    async with channel:
        start = time.perf_counter()
        for offset in range(0, len(payload), CHUNK):
            await channel.send(payload[offset : offset + CHUNK])
        assert await channel.receive() == b"\x01"
        return time.perf_counter() - start


def start_receiver(mode: str, total: int, swarm: Swarm) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--receiver", mode, "--bytes", str(total), "--key", swarm.key.hex()],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    address = proc.stdout.readline().strip()
    if not address:
        raise SystemExit(f"receiver for {mode} did not start")
    return proc, address


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="payload in MB (10^6 bytes)")
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--receiver", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver:
        trio.run(receiver, args.receiver, args.bytes, bytes.fromhex(args.key))
        return

    total = int(args.mb * 1e6)
    payload = memoryview(os.urandom(total))
    swarm = Swarm.generate("bench")
    receivers = {mode: start_receiver(mode, total, swarm) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        for trial in range(args.trials):
            for mode in MODES[trial % len(MODES):] + MODES[:trial % len(MODES)]:
                address = receivers[mode][1]
                if mode == "plain":
                    seconds = trio.run(send_plain, address, payload)
                else:
                    seconds = trio.run(send_secure, address, payload,
                                       Swarm(swarm.name, swarm.key, mode))
                times[mode].append(seconds)
                print(f"trial {trial + 1}/{args.trials} {mode:6s} {total / seconds / 1e6:8.1f} MB/s",
                      file=sys.stderr, flush=True)
    finally:
        for proc, _ in receivers.values():
            proc.stdin.close()
            proc.wait(timeout=10)

    rate = {mode: total / statistics.median(t) / 1e6 for mode, t in times.items()}
    ratio = {mode: rate[mode] / rate["plain"] for mode in MODES}
    print(f"\n{total / 1e6:.0f} MB from one process to another over 127.0.0.1, median of "
          f"{args.trials} (modes in rotating order)")
    print(f"{'transport':<38}{'MB/s':>10}{'seconds':>10}{'vs plain':>10}")
    for mode in MODES:
        label = "plain TCP" if mode == "plain" else f"secure channel ({mode}" + (
            ", default)" if mode == DEFAULT_CIPHER else ")")
        median = statistics.median(times[mode])
        print(f"{label:<38}{rate[mode]:>10.1f}{median:>10.3f}{ratio[mode]:>10.2f}")
    print(f"target: secure ({DEFAULT_CIPHER}) vs plain >= {TARGET_SECURE_VS_PLAIN} -> "
          f"{'met' if ratio[DEFAULT_CIPHER] >= TARGET_SECURE_VS_PLAIN else 'MISSED'}")
    print(json.dumps({
        "bytes": total,
        "trials": args.trials,
        "plain_mb_s": round(rate["plain"], 1),
        "secure_mb_s": round(rate[DEFAULT_CIPHER], 1),
        "secure_vs_plain": round(ratio[DEFAULT_CIPHER], 3),
        **{f"{mode}_mb_s": round(rate[mode], 1) for mode in CIPHERS},
        **{f"{mode}_vs_plain": round(ratio[mode], 3) for mode in CIPHERS},
    }))


if __name__ == "__main__":
    main()
