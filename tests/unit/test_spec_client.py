"""An independent client written from docs/PROTOCOL.md alone, run against the reference server.

Nothing here comes from gossip/ except the server side of each test (serve, send_state,
Identity, Swarm, TcpNetwork, tensors.StateSchema/snapshot, and for membership open_roster,
MembershipConfig, State and the roster's own view and statistics). The client's handshake,
record layer, CBOR codec, state decoding, datagram sealing and membership messages follow the
spec's text and check its test vectors.
"""

import base64
import functools
import hashlib
import hmac
import os
import socket
import struct

import cbor2
import pytest
import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from gossip import Identity, Swarm, tensors
from gossip.lowlevel import TcpNetwork, send_state, serve
from gossip.config import MembershipConfig, NodeConfig
from gossip.membership import State
from gossip.roster import open_roster

# --- section 1.1 constants ---------------------------------------------------------------
PROTOCOL_NAMES = {"aesgcm": b"Noise_XXpsk0_25519_AESGCM_SHA256",
                  "chachapoly": b"Noise_XXpsk0_25519_ChaChaPoly_SHA256"}
PROLOGUE = b"gossipd"
SIGNATURE_PREFIX = b"gossipd-noise-static-key:"
MAX_HANDSHAKE_MESSAGE = 65535
MAX_RECORD = 1 << 20
MAX_MESSAGE = 65536
FIELD_COUNTS = {1: 4, 2: 2, 3: 2, 4: 5,  # section 6.3 tag table
                5: 2, 6: 2, 7: 3, 8: 1, 9: 1, 10: 11, 11: 3, 12: 3, 13: 4, 14: 12, 15: 3,
                16: 6, 17: 4, 18: 1, 19: 4, 20: 3, 21: 1}
CODEC_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # section 7.3


def raw_pub(key) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def peer_id(identity_public_key: bytes) -> str:  # section 3.2
    digest = hashlib.sha256(identity_public_key).digest()[:16]
    return base64.b32encode(digest).decode().rstrip("=").lower()


class Aead:  # section 1: the swarm's cipher, a 64-bit counter in its nonce encoding
    def __init__(self, cipher: str, key: bytes):
        self.aead = {"aesgcm": AESGCM, "chachapoly": ChaCha20Poly1305}[cipher](key)
        self.order = ">" if cipher == "aesgcm" else "<"  # u64be / u64le

    def nonce(self, n: int) -> bytes:  # 00 00 00 00 || u64(n)
        return b"\0\0\0\0" + struct.pack(self.order + "Q", n)

    def encrypt(self, n: int, p: bytes, ad: bytes) -> bytes:
        return self.aead.encrypt(self.nonce(n), p, ad)

    def decrypt(self, n: int, c: bytes, ad: bytes) -> bytes:
        return self.aead.decrypt(self.nonce(n), c, ad)


def hkdf(ck: bytes, ikm: bytes, m: int):  # section 4.3
    t = hmac.digest(ck, ikm, "sha256")
    out, prev = [], b""
    for i in range(1, m + 1):
        prev = hmac.digest(t, prev + bytes([i]), "sha256")
        out.append(prev)
    return out


def dh(priv: X25519PrivateKey, pub: bytes) -> bytes:
    out = priv.exchange(X25519PublicKey.from_public_bytes(pub))
    assert out != bytes(32), "all-zero DH output (section 4.7)"
    return out


# --- section 6: canonical CBOR messages --------------------------------------------------
def encode_message(tag: int, *fields) -> bytes:
    data = cbor2.dumps([tag, *fields], canonical=True)
    assert len(data) <= MAX_MESSAGE
    return data


def decode_message(data: bytes) -> list:
    assert len(data) <= MAX_MESSAGE
    msg = cbor2.loads(data)
    assert cbor2.dumps(msg, canonical=True) == data, "not canonical (section 6.2)"
    assert isinstance(msg, list) and msg, "top level must be a non-empty array"
    tag = msg[0]
    assert type(tag) is int and tag in FIELD_COUNTS, f"unknown tag {tag!r}"
    assert len(msg) == 1 + FIELD_COUNTS[tag]
    return msg


# --- section 4: Noise XXpsk0 symmetric state and initiator ---------------------------------
class SymmetricState:
    def __init__(self, cipher: str):
        self.cipher, name = cipher, PROTOCOL_NAMES[cipher]
        # section 4.4: up to 32 bytes padded with zeros, longer hashed
        self.h = name.ljust(32, b"\0") if len(name) <= 32 else hashlib.sha256(name).digest()
        self.ck = self.h
        self.k, self.n = None, 0
        self.mix_hash(PROLOGUE)

    def mix_hash(self, data: bytes):
        self.h = hashlib.sha256(self.h + data).digest()

    def mix_key(self, ikm: bytes):
        self.ck, self.k = hkdf(self.ck, ikm, 2)
        self.n = 0

    def mix_key_and_hash(self, ikm: bytes):
        self.ck, th, self.k = hkdf(self.ck, ikm, 3)
        self.mix_hash(th)
        self.n = 0

    def encrypt_and_hash(self, p: bytes) -> bytes:
        c = Aead(self.cipher, self.k).encrypt(self.n, p, self.h)
        self.n += 1
        self.mix_hash(c)
        return c

    def decrypt_and_hash(self, c: bytes) -> bytes:
        p = Aead(self.cipher, self.k).decrypt(self.n, c, self.h)
        self.n += 1
        self.mix_hash(c)
        return p

    def split(self):
        return hkdf(self.ck, b"", 2)  # (k1: initiator->responder, k2: responder->initiator)


class Initiator:
    """Sans-IO initiator: message bodies in and out, without the 4-byte length prefix."""

    def __init__(self, psk, swarm_name, identity, s=None, e=None, cipher="aesgcm"):
        self.psk, self.swarm_name, self.identity = psk, swarm_name, identity
        self.s = s or X25519PrivateKey.generate()
        self.e = e or X25519PrivateKey.generate()
        self.ss = SymmetricState(cipher)

    def message1(self) -> bytes:  # -> psk, e
        self.ss.mix_key_and_hash(self.psk)
        e_pub = raw_pub(self.e)
        self.ss.mix_hash(e_pub)
        self.ss.mix_key(e_pub)  # the psk-mode extra MixKey (Noise §9.2)
        return e_pub + self.ss.encrypt_and_hash(b"")

    def read_message2(self, body: bytes) -> bytes:  # <- e, ee, s, es; returns the peer's identity key
        assert len(body) >= 32 + 48 + 16, "truncated message 2"
        self.re = body[:32]
        self.ss.mix_hash(self.re)
        self.ss.mix_key(self.re)
        self.ss.mix_key(dh(self.e, self.re))
        self.rs = self.ss.decrypt_and_hash(body[32:80])
        self.ss.mix_key(dh(self.e, self.rs))
        self.hello_r = self.ss.decrypt_and_hash(body[80:])
        tag, version, swarm, identity_key, signature = decode_message(self.hello_r)
        assert tag == 1 and version == 1 and swarm == self.swarm_name
        assert type(identity_key) is bytes and len(identity_key) == 32 and len(signature) == 64
        Ed25519PublicKey.from_public_bytes(identity_key).verify(signature, SIGNATURE_PREFIX + self.rs)
        return identity_key

    def message3(self) -> bytes:  # -> s, se
        s_pub = raw_pub(self.s)
        out = self.ss.encrypt_and_hash(s_pub)
        self.ss.mix_key(dh(self.s, self.re))
        signature = self.identity.sign(SIGNATURE_PREFIX + s_pub)
        hello = encode_message(1, 1, self.swarm_name, raw_pub(self.identity), signature)
        return out + self.ss.encrypt_and_hash(hello)


# --- section 5: the client over TCP ------------------------------------------------------
async def recv_exact(stream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            raise EOFError(f"end of stream after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


class Client:
    @classmethod
    async def connect(cls, address: str, swarm_name: str, psk: bytes, identity=None,
                      cipher="aesgcm"):
        self = cls()
        host, port = address.rsplit(":", 1)
        self.stream = await trio.open_tcp_stream(host.strip("[]"), int(port))
        self.identity = identity or Ed25519PrivateKey.generate()
        hs = Initiator(psk, swarm_name, self.identity, cipher=cipher)
        msg1 = hs.message1()
        await self.stream.send_all(struct.pack(">I", len(msg1)) + msg1)
        (length,) = struct.unpack(">I", await recv_exact(self.stream, 4))
        assert length <= MAX_HANDSHAKE_MESSAGE
        self.server_identity_key = hs.read_message2(await recv_exact(self.stream, length))
        msg3 = hs.message3()
        await self.stream.send_all(struct.pack(">I", len(msg3)) + msg3)
        k1, k2 = hs.ss.split()
        self.send_aead, self.recv_aead = Aead(cipher, k1), Aead(cipher, k2)
        self.send_n = self.recv_n = 0
        return self

    async def send_record(self, plaintext: bytes):
        assert len(plaintext) <= MAX_RECORD
        header = struct.pack(">I", len(plaintext) + 16)
        ct = self.send_aead.encrypt(self.send_n, plaintext, header)
        self.send_n += 1
        await self.stream.send_all(header + ct)

    async def recv_record(self) -> bytes:
        header = await recv_exact(self.stream, 4)
        (length,) = struct.unpack(">I", header)
        assert 16 <= length <= MAX_RECORD + 16
        pt = self.recv_aead.decrypt(self.recv_n, await recv_exact(self.stream, length), header)
        self.recv_n += 1
        return pt

    async def send_message(self, tag: int, *fields):
        await self.send_record(encode_message(tag, *fields))

    async def recv_message(self) -> list:
        return decode_message(await self.recv_record())

    async def recv_state(self, fingerprint: bytes, numel: int, codec: str):  # section 7.5
        tag, fp, hdr_codec, step, samples, nbytes = await self.recv_message()
        assert tag == 4, f"expected StateHeader, got tag {tag}"
        assert (fp, hdr_codec, nbytes) == (fingerprint, codec, numel * CODEC_BYTES[codec])
        data, records = bytearray(), 0
        while len(data) < nbytes:
            rec = await self.recv_record()
            assert rec and len(rec) % CODEC_BYTES[codec] == 0 and len(data) + len(rec) <= nbytes
            data += rec
            records += 1
        return (step, samples), bytes(data), records


def schema_fingerprint(entries) -> bytes:  # section 7.1
    return hashlib.sha256(cbor2.dumps([[n, list(s), d] for n, s, d in entries], canonical=True)).digest()[:16]


def schema_of(model: torch.nn.Module):  # section 7.1, informative: floating tensors, state_dict order
    seen, entries = set(), []
    for name, t in model.state_dict().items():
        if not t.is_floating_point() or (t.data_ptr(), t.shape) in seen:
            continue
        seen.add((t.data_ptr(), t.shape))
        entries.append((name, tuple(t.shape), str(t.dtype).removeprefix("torch.")))
    return entries


# --- tests: spec vectors -----------------------------------------------------------------
def test_peer_id_vectors():
    assert peer_id(bytes(32)) == "mzuhvlpymk6xo3epygfy5h4oea"
    seed = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
    assert peer_id(raw_pub(Ed25519PrivateKey.from_private_bytes(seed))) == "eh7ddx5bksrgcytl7bkai36se4"


def test_cbor_and_fingerprint_vectors():
    assert encode_message(2, 0, "bye").hex() == "83020063627965"
    entries = [("fc.weight", (4, 2), "float32"), ("fc.bias", (4,), "float32")]
    assert schema_fingerprint(entries).hex() == "6b258ea925054d0b695d3dba4bc4c382"
    assert struct.pack("<6f", 1.0, -2.0, 0.5, 3.14159, 100000.0, -1e-8).hex() == (
        "0000803f000000c00000003fd00f49400050c34777cc2bb2")  # section 7.3, fp32
    assert schema_fingerprint([("w", (2, 3), "float32")]).hex() == "9679fd51f362229c65de22dd47d2b393"
    assert schema_fingerprint([]).hex() == "76be8b528d0075f7aae98d6fa57a6d3c"
    fp = bytes.fromhex("9679fd51f362229c65de22dd47d2b393")
    assert encode_message(4, fp, "bf16", 1000, 64000, 12).hex() == "8604" "50" + fp.hex() + "6462663136" "1903e8" "19fa00" "0c"


OFFER, ACCEPT = 16, 17  # section 6.3


def test_offer_and_accept_vectors():  # section 6.4
    fp = bytes.fromhex("9679fd51f362229c65de22dd47d2b393")
    offer = "8710" "50" + fp.hex() + "6466703332" "1903e8" "19fa00" "f90000"
    assert encode_message(OFFER, fp, "fp32", 1000, 64000, 0.0, False).hex() == offer + "f4"
    assert encode_message(OFFER, fp, "fp32", 1000, 64000, 0.0, True).hex() == offer + "f5"
    assert len(bytes.fromhex(offer + "f4")) == 34
    push_sum = "8710" "50" + fp.hex() + "6462663136" "1903e8" "19fa00" "fa477a0100"
    assert encode_message(OFFER, fp, "bf16", 1000, 64000, 64001.0, False).hex() == push_sum + "f4"
    assert encode_message(OFFER, fp, "bf16", 1000, 64000, 64001.0, True).hex() == push_sum + "f5"
    assert len(bytes.fromhex(push_sum + "f4")) == 36
    accept = "8511" "1904b0" "1a00012c00"
    assert encode_message(ACCEPT, 1200, 76800, 0.0, False).hex() == accept + "f90000" "f4"
    assert encode_message(ACCEPT, 1200, 76800, 0.0, True).hex() == accept + "f90000" "f5"
    assert encode_message(ACCEPT, 1200, 76800, 76801.0, False).hex() == accept + "fa47960080" "f4"
    assert encode_message(ACCEPT, 1200, 76800, 76801.0, True).hex() == accept + "fa47960080" "f5"
    assert len(bytes.fromhex(accept + "f90000f4")) == 14 and len(bytes.fromhex(accept + "fa47960080f4")) == 16
    assert decode_message(bytes.fromhex(offer + "f5")) == [OFFER, fp, "fp32", 1000, 64000, 0.0, True]
    assert decode_message(bytes.fromhex(accept + "f90000f4")) == [ACCEPT, 1200, 76800, 0.0, False]
    for old_arity in (encode_message(OFFER, fp, "fp32", 1000, 64000, 0.0), encode_message(ACCEPT, 1200, 76800, 0.0)):
        with pytest.raises(AssertionError):  # section 6.2: exactly 1 + the number of fields
            decode_message(old_arity)


# Appendix A.1 (aesgcm) and A.2 (chachapoly); the Hello payloads are the same in both.
APPENDIX_A = {
    "aesgcm": dict(
        h0="98367bfeb84324d6dd470e8042d5bd9555e933db84787ff5dff7eee7fbdff130",
        h1="4fb2713b4db3d7cb9312f01e084d6b52a79b330c46f1b8db34b1900a8b1cae6f",
        h2="e039d3102038138409e110a17c6aec1e4a266960f497f177359def800266abab",
        ck2="084bffb18ac3143535df254fb2e336c413d2e49134f54da120d1b2407c34cbfd",
        h3="31b445ade25cd6df455700141c4fb65e23ff53480c6c2a2c40aa97c0b21f0798",
        k1="112fafe47c02689f4126caf70f9022df09fbb51b62bc7f46f9bf84c30ea6140c",
        k2="779aa2c47da26a835834992f00ac92d1742cf254aae5ee2abd4c90a831c81805",
        second="15e9d79adafeb59aa39bc98b0baa3a95a883d41745ac8f",
        resp="201a351cbc4efca90cbdd8a67bc8ff01c5a991e0abcde8",
        msg1="""
0faa684ed28867b97f4a6a2dee5df8ce974e76b7018e3f22a1c4cf2678570f2031a4d1e898f9e83bb24ddfc8e29b78bb""".replace("\n", ""),
        msg2="""
ff2ee45601ec1b67310c7790404585ae697331eee1c1f8cf2419731c1fff3e6bda4012a26d5efaba3d24f21a129a269d
10d82852f57573eb51c4adbc8c1eb36032a9a4eb3e01c113b370e6a5907c520370c2d0e348611f61cf90d56da9e79e89
976e0e749e5095bf749df7fe3dd634c68ae3c1a606b249f10abfb2bc8e60842449568da1b70bafb0aedd6e69b8052da6
a2ba1c1b97f1383002cbdb31ea7d81ba738fdd8b369ff3ee3acbb27e3b53e2247ce683168dd67af6eee14fdb914d752d
7a3819416a90a1a42e40edc3""".replace("\n", ""),
        msg3="""
149fa787b8c8d3887612c62e45d259b44be46c72bb04f5e5241a1757d8b7c5b09050a2d36c562c94f0d4178b0d26cfe2
a1ee4e046437a684b7848a62482cc21526ee1d5adcaaba436b9fb1ec84caacaee6e5c26902cda943494caf870fc3ef8a
ab18bf7b00bc0494f6bc47307793048eff4fd152d1364ee4d182941a38c585218424e3b88614e92fd69aac059eb11609
df95fb5c4c84c097f04df03b674040368d0e9d370d6cc6f746f6dd37""".replace("\n", ""),
    ),
    "chachapoly": dict(
        h0="218a48359410cb770f76236db6b96415270fa857284a29a5b287fe04d6ca4466",
        h1="52e259fdcc68582dd85167e7d4d053fa00be26123f98ea0054e3da04f2df9e27",
        h2="7eb06101ef724275651a145bdbd6eca4b99b794ba67bbf3fcae2658ce352dcb9",
        ck2="93dface46f212ae4af507818b34062b2fd7e6e5aa2b15618d5cbfadd0139aecb",
        h3="9f4b0676da0bd7e42269e91aa5d719b9333fe76cade07439f076ca3b11cbec6c",
        k1="2a4dc5952691d4b98f8e6c631a3b863d6af03cc7531f497bdf46184fb1d9908a",
        k2="b37d29e80d16591a3a5c8983a9588285122c209802834dbc7aecbd20dffbc4ba",
        second="46e1ce2ab3a89cfbf8a6194df6dd569079546b5a1076df",
        resp="dbb48cfb249dd4a5d91d2b242a6ef8736227cabdc1f20e",
        msg1="""
0faa684ed28867b97f4a6a2dee5df8ce974e76b7018e3f22a1c4cf2678570f20903fafbe3e5d2d535565a0a7cb6a96b8""".replace("\n", ""),
        msg2="""
ff2ee45601ec1b67310c7790404585ae697331eee1c1f8cf2419731c1fff3e6ba5972002b956082fef756c827fb017fd
bf700d4805a991552826a315a073e59e02c901d2d0c390db7490d08dec7656eba69e3a2059a5d65d31b7ea8c05375ff9
48a186d645668b0f47ff7f4cf0017b0b736abae0e41cd2f3fe5d3c006d766e936f08c0a1b2b23f9208ca504f616e26c8
1ebb2f673aea00ff3cf75cf398760a484817c692c77b21e0bbc7972a66672e62dc7e94e38a86b8203049c0507b9a1717
c658a7b43a648d7915bf8d1f""".replace("\n", ""),
        msg3="""
20304b9578e26f917880dba0b2bca4c7c19bac9d02a6df9d5d2fcdb7f0a0b45a9aa96c8459624564da6a981eaf4eff0c
e160dafa88fbf2c92e3b5de3f77703948868d002208708ec6d334c71c59aa63ca1d0de5d52aba84275a6d81d948da2de
84eaaaf89919effca0be13839ec0fd45743dcb61506be29ad51c9a23471b7bc9c8edbaba8794f2d3fd7a918bc57b17ed
80811e748a176580077ff7a86f2727f000c104f571b2b8bf339c3f78""".replace("\n", ""),
    ),
}


@pytest.mark.parametrize("cipher", ["aesgcm", "chachapoly"])
def test_appendix_a_initiator_messages(cipher):
    v = APPENDIX_A[cipher]
    x = lambda b: X25519PrivateKey.from_private_bytes(bytes([b]) * 32)
    ident = Ed25519PrivateKey.from_private_bytes(
        bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60"))
    hs = Initiator(bytes(range(32)), "demo", ident, s=x(0x11), e=x(0x22), cipher=cipher)
    assert hs.ss.h.hex() == v["h0"]
    assert hs.message1().hex() == v["msg1"]
    assert hs.ss.h.hex() == v["h1"]
    msg2 = bytes.fromhex(v["msg2"])
    assert len(msg2) == 204 == 32 + 48 + 108 + 16  # section 4.5: u32be(96 + H)
    assert peer_id(hs.read_message2(msg2)) == "hh3rhufgiqst6bcssqq3t5i3tm"
    assert hs.hello_r.hex() == APPENDIX_A_HELLO_R
    assert hs.ss.h.hex() == v["h2"]
    assert hs.ss.ck.hex() == v["ck2"]
    assert hs.message3().hex() == v["msg3"]
    assert hs.ss.h.hex() == v["h3"]
    k1, k2 = hs.ss.split()
    assert k1.hex() == v["k1"]
    assert k2.hex() == v["k2"]
    header, bye = bytes.fromhex("00000017"), encode_message(2, 0, "bye")
    assert Aead(cipher, k1).encrypt(1, bye, header).hex() == v["second"]
    assert Aead(cipher, k2).decrypt(0, bytes.fromhex(v["resp"]), header) == bye


APPENDIX_A_HELLO_R = (
    "8501016464656d6f58203d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c58404a260aee130a44eb737b"
    "e3dc1c245a86958df3ac0b305349b0d924b477eb5c2b4a8197a79348092ae0c71fecd1f13f698c0b6a0bf7f7feaaf2be172a2c455804")


# --- tests: against the reference server -------------------------------------------------
SWARM_NAME = "spec-test"


async def start_server(nursery, handler, swarm_key, cipher="aesgcm"):
    ident = Identity.generate()
    swarm = Swarm(SWARM_NAME, swarm_key, cipher)
    address = await nursery.start(functools.partial(
        serve, TcpNetwork(), "127.0.0.1:0", handler, identity=ident, swarm=swarm))
    return ident, str(address)


@pytest.mark.parametrize("cipher", ["aesgcm", "chachapoly"])
async def test_handshake_peer_ids_and_records(nursery, cipher):
    key = os.urandom(32)
    seen_send, seen_recv = trio.open_memory_channel(1)

    async def handler(channel):
        await seen_send.send(channel.peer)
        for _ in range(3):  # records n = 0, 1, 2 each way: the nonce's byte order shows
            await channel.send(await channel.receive())

    ident, address = await start_server(nursery, handler, key, cipher)
    client = await Client.connect(address, SWARM_NAME, key, cipher=cipher)
    assert peer_id(client.server_identity_key) == ident.peer_id
    assert client.server_identity_key == ident.public_key
    assert await seen_recv.receive() == peer_id(raw_pub(client.identity))
    for n in range(3):
        await client.send_record(b"echo %d" % n)
        assert await client.recv_record() == b"echo %d" % n


async def test_receive_fp32_state(nursery):
    key = os.urandom(32)
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 1000)
    schema = tensors.StateSchema.from_module(model)
    flat = tensors.snapshot(model, schema)

    async def handler(channel):
        await send_state(channel, flat, schema, "fp32", step=7, samples=9)
        await trio.sleep_forever()  # keep the channel open until the test ends

    _, address = await start_server(nursery, handler, key)
    client = await Client.connect(address, SWARM_NAME, key)
    entries = schema_of(model)
    assert entries == [("weight", (1000, 300), "float32"), ("bias", (1000,), "float32")]
    numel = sum(torch.Size(s).numel() for _, s, _ in entries)
    counters, data, records = await client.recv_state(schema_fingerprint(entries), numel, "fp32")
    assert counters == (7, 9)
    assert records == 2  # 1 MiB + the rest
    received = torch.frombuffer(bytearray(data), dtype=torch.float32)  # little-endian host
    assert torch.equal(received, flat)
    assert data == flat.numpy().astype("<f4").tobytes()


async def test_close_message_reaches_handler(nursery):
    key = os.urandom(32)
    got_send, got_recv = trio.open_memory_channel(1)

    async def handler(channel):
        msg = await channel.receive_message()
        await got_send.send((msg.code, msg.reason))

    _, address = await start_server(nursery, handler, key)
    client = await Client.connect(address, SWARM_NAME, key)
    await client.send_message(2, 4, "shutting down — ünïcode")
    assert await got_recv.receive() == (4, "shutting down — ünïcode")
    await client.stream.aclose()


async def test_wrong_swarm_key_gets_no_bytes(nursery):
    called = []

    async def handler(channel):
        called.append(channel.peer)

    _, address = await start_server(nursery, handler, os.urandom(32))
    host, port = address.rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    msg1 = Initiator(os.urandom(32), SWARM_NAME, Ed25519PrivateKey.generate()).message1()
    assert len(msg1) == 48
    await stream.send_all(struct.pack(">I", 48) + msg1)
    received = b""
    try:
        while chunk := await stream.receive_some(65536):
            received += chunk
    except trio.BrokenResourceError:
        pass  # a reset is allowed (section 2)
    assert received == b""
    assert called == []
    await stream.aclose()


# --- section 8: membership ---------------------------------------------------------------
MEMBERSHIP_INFO = b"gossipd membership v1:"  # section 8.2
SEAL_VERSION = b"\x01"
SEAL_OVERHEAD = 1 + 12 + 16
MAX_DATAGRAM = 1400
PACKET, PING, ACK, ALIVE_TAG, PUSH_PULL, MEMBER_STATE = 5, 6, 8, 10, 15, 14  # section 6.3
ALIVE = 0  # MemberState.state
CLAIM_CONTEXT = b"gossipd-membership-claim:"  # section 8.6, proofs


def alive_row(identity: Ed25519PrivateKey, *fields) -> bytes:
    """Section 8.7: an ALIVE MemberState row, proven by the member's signature of its Alive
    (section 8.6: the context, then the canonical CBOR of [10, peer, incarnation, ...])."""
    peer, incarnation, *meta = fields
    signed = CLAIM_CONTEXT + cbor2.dumps([ALIVE_TAG, peer, incarnation, *meta], canonical=True)
    return encode_message(MEMBER_STATE, peer, incarnation, ALIVE, *meta, raw_pub(identity),
                          identity.sign(signed))


def row_is_proven(row: list) -> bool:
    """Section 8.6: the row's key is its peer's, and signs the row's Alive."""
    _, peer, incarnation, state, *meta, key, signature = row
    if state != ALIVE or peer_id(key) != peer:
        return False
    signed = CLAIM_CONTEXT + cbor2.dumps([ALIVE_TAG, peer, incarnation, *meta], canonical=True)
    try:
        Ed25519PublicKey.from_public_bytes(key).verify(signature, signed)
    except Exception:  # InvalidSignature: any failure is "not proven" here
        return False
    return True


def membership_key(swarm_name: str, swarm_key: bytes) -> bytes:
    """Section 8.2: RFC 5869 HKDF-SHA256 without salt (32 zero bytes), one 32-byte block."""
    prk = hmac.digest(bytes(32), swarm_key, "sha256")
    return hmac.digest(prk, MEMBERSHIP_INFO + swarm_name.encode() + b"\x01", "sha256")


def seal(key: bytes, plaintext: bytes, nonce12: bytes | None = None) -> bytes:
    nonce12 = os.urandom(12) if nonce12 is None else nonce12  # the 12 bytes as they are
    datagram = SEAL_VERSION + nonce12 + ChaCha20Poly1305(key).encrypt(nonce12, plaintext, SEAL_VERSION)
    assert len(datagram) <= MAX_DATAGRAM
    return datagram


def unseal(key: bytes, datagram: bytes) -> bytes:  # section 8.2 steps 1-4 (raises on a drop)
    assert SEAL_OVERHEAD <= len(datagram) <= MAX_DATAGRAM and datagram[:1] == SEAL_VERSION
    return ChaCha20Poly1305(key).decrypt(datagram[1:13], datagram[13:], SEAL_VERSION)


def encode_packet(sender: str, *parts: bytes) -> bytes:  # section 8.3: parts are encoded messages
    return encode_message(PACKET, sender, list(parts))


def decode_packet(plaintext: bytes) -> tuple[str, list[list]]:
    tag, sender, parts = decode_message(plaintext)
    assert tag == PACKET and len(sender) == 26 and len(parts) <= 64
    assert all(type(part) is bytes for part in parts)
    return sender, [decode_message(part) for part in parts]


APPENDIX_B_KEY = "e055dbf388f328de62ef616bdf830250ce3d385ec35e2efe5b907ffdc5619bbe"
APPENDIX_B_PLAINTEXT = (
    "8305781a65683764647835626b7372676379746c37626b6169333673653481581f"
    "830601781a686833726875666769717374366263737371713374356933746d")
APPENDIX_B_SEALED = (
    "01000102030405060708090a0b8b6f4ae467e009d26b296bca8e45adfe2f06f61e77a154e12967da26f0953990"
    "f46322a9bd9339d431cbac2cdb0fea6f841beb41d2c2170465b932bac644fe7f3db1f4874405473f5200a7cf78"
    "4e2334")


def test_appendix_b_sealed_datagram():
    swarm_key = bytes(range(32))
    key = membership_key("test-vector", swarm_key)
    assert key.hex() == APPENDIX_B_KEY
    # The same key from a stock RFC 5869 implementation (not the Noise HKDF of section 4.3).
    assert key == HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                       info=b"gossipd membership v1:test-vector").derive(swarm_key)
    ping = encode_message(PING, 1, "hh3rhufgiqst6bcssqq3t5i3tm")
    assert ping.hex() == "830601781a686833726875666769717374366263737371713374356933746d"  # section 6.4
    packet = encode_packet("eh7ddx5bksrgcytl7bkai36se4", ping)
    assert packet.hex() == APPENDIX_B_PLAINTEXT
    sealed = seal(key, packet, bytes(range(12)))
    assert sealed.hex() == APPENDIX_B_SEALED
    assert len(sealed) == 93 == len(packet) + SEAL_OVERHEAD
    assert decode_packet(unseal(key, sealed)) == ("eh7ddx5bksrgcytl7bkai36se4", [[6, 1, "hh3rhufgiqst6bcssqq3t5i3tm"]])
    test2 = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(
        "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb"))  # RFC 8032 TEST 2
    member = alive_row(test2, "hh3rhufgiqst6bcssqq3t5i3tm", 3, "10.0.0.2:7070", 1, 1200, True,
                       3, 8, True)  # shard 3 of 8, reachable; then its proof (section 6.4)
    assert len(member) == 154 and row_is_proven(decode_message(member))
    assert member[88:].hex() == (
        "584040a8a4035dcf5c5007fc1eb51de9f90b6723f31783fce6ef2f7aa783c33da349023d5cd9484617edff92"
        "a58e3427e5ad41b89f752e68b2442ace5bf6deca5c09")
    assert encode_message(PUSH_PULL, True, True, [member]) == bytes.fromhex("840ff5f581589a") + member


# --- tests: membership against a reference roster -----------------------------------------
FAST = MembershipConfig(probe_interval=0.2, probe_timeout=0.1, leave_timeout=0.1)


async def udp_socket():
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    await sock.bind(("127.0.0.1", 0))
    return sock, "%s:%d" % sock.getsockname()


def host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


async def receive_packet(sock, key):
    data, source = await sock.recvfrom(MAX_DATAGRAM + 1)
    sender, messages = decode_packet(unseal(key, data))
    return sender, messages, "%s:%d" % source[:2]


async def test_ping_is_acked_only_for_its_own_peer_id():
    swarm_key = os.urandom(32)
    ident = Identity.generate()
    async with open_roster(TcpNetwork(), ident, Swarm(SWARM_NAME, swarm_key),
                           NodeConfig(listen="127.0.0.1:0", membership=FAST)) as roster:
        key = membership_key(SWARM_NAME, swarm_key)
        me = peer_id(raw_pub(Ed25519PrivateKey.generate()))
        sock, _ = await udp_socket()
        with sock:
            async def ping_and_wait_for_ack(seq: int) -> None:
                await sock.sendto(seal(key, encode_packet(me, encode_message(PING, seq, ident.peer_id))),
                                  host_port(roster.address))
                with trio.fail_after(5):
                    while True:
                        sender, messages, source = await receive_packet(sock, key)
                        if [ACK, seq] in messages:
                            break
                assert sender == ident.peer_id
                assert source == roster.address  # section 8.5: sent from the node's address

            await ping_and_wait_for_ack(7)
            # A Ping for another peer id, and one sealed with another swarm key: no answer.
            other = peer_id(raw_pub(Ed25519PrivateKey.generate()))
            await sock.sendto(seal(key, encode_packet(me, encode_message(PING, 8, other))),
                              host_port(roster.address))
            wrong_key = membership_key(SWARM_NAME, os.urandom(32))
            await sock.sendto(seal(wrong_key, encode_packet(me, encode_message(PING, 9, ident.peer_id))),
                              host_port(roster.address))
            with trio.move_on_after(0.3):
                data, _ = await sock.recvfrom(MAX_DATAGRAM + 1)
                raise AssertionError(f"unexpected datagram: {decode_packet(unseal(key, data))}")
            await ping_and_wait_for_ack(2**32 - 1)  # still answering; the largest seq decodes
        assert roster.statistics().datagrams_rejected == 1  # the wrong key: dropped and counted


async def receive_table(client: Client) -> list[list]:
    records = []
    while True:  # section 8.7: pages up to the one marked last
        tag, join, last, page = await client.recv_message()
        assert tag == PUSH_PULL and join is False and len(page) <= 256
        records += [decode_message(record) for record in page]
        if last:
            return records


async def test_join_by_push_pull_then_answer_probes():
    swarm_key = os.urandom(32)
    ident = Identity.generate()
    async with open_roster(TcpNetwork(), ident, Swarm(SWARM_NAME, swarm_key),
                           NodeConfig(listen="127.0.0.1:0", membership=FAST)) as roster:
        key = membership_key(SWARM_NAME, swarm_key)
        identity = Ed25519PrivateKey.generate()
        me = peer_id(raw_pub(identity))
        sock, my_address = await udp_socket()
        probed = trio.Event()

        async def answer_pings():  # section 8.5: Ack(seq) to the source of a Ping for us
            while True:
                _, messages, source = await receive_packet(sock, key)
                for message in messages:
                    if message[0] == PING and message[2] == me:
                        await sock.sendto(seal(key, encode_packet(me, encode_message(ACK, message[1]))),
                                          host_port(source))
                        assert source == roster.address
                        probed.set()

        with sock:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(answer_pings)
                mine = alive_row(identity, me, 0, my_address, 1, 0, False, 2, 4, True)
                with trio.fail_after(5):
                    client = await Client.connect(roster.address, SWARM_NAME, swarm_key, identity=identity)
                    assert peer_id(client.server_identity_key) == ident.peer_id
                    await client.send_message(PUSH_PULL, True, True, [mine])  # step 1: join
                    table = await receive_table(client)  # step 2
                    await client.send_message(PUSH_PULL, False, True, [mine])  # step 3
                    await client.stream.aclose()
                # The responder's own record comes first, ALIVE; it merged ours before answering.
                tag, peer, incarnation, state, address, version, step, ready, shard, shards, reachable, _, _ = table[0]
                assert (tag, peer, state, address, version) == (MEMBER_STATE, ident.peer_id, ALIVE, roster.address, 1)
                assert (shard, shards, reachable) == (0, 0, True)  # no data shard; reachable
                assert row_is_proven(table[0])  # its own Alive, signed by its identity key
                assert decode_message(mine) in table[1:]
                with trio.fail_after(5):
                    while not any(m.peer == me and m.state == State.ALIVE and m.address == my_address
                                  and (m.shard, m.shards) == (2, 4) for m in roster.members()):
                        await roster.wait_changed()
                    await probed.wait()  # the roster probes us at the address we announced
                nursery.cancel_scope.cancel()
        assert roster.statistics().suspicions == 0
