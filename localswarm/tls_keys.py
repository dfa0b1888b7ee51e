"""tls.PrivateKey as the rehearsal's `tls` plugin makes it: a real key of the algorithm asked, in the formats
pulumi-tls 5.x returns, and the inputs its Check refuses.

pulumi-tls bridges terraform-provider-tls (internal/provider/resource_private_key.go): `algorithm` is one of
RSA, ECDSA and ED25519 (a OneOf validator, so a bad one fails the preview), `rsa_bits` defaults to 2048
(no validator: a bad size fails the create) and `ecdsa_curve` to P224, one of P224, P256, P384 and P521, checked whatever the algorithm. It returns the private key as PEM (PKCS#1 "RSA
PRIVATE KEY", SEC 1 "EC PRIVATE KEY", PKCS#8 "PRIVATE KEY" for ED25519), as PKCS#8 and as OpenSSH, and
the public key as PEM and in authorized_keys form (no comment) with its MD5 and SHA256 fingerprints. OpenSSH
has no P224 curve: that key's OpenSSH forms and fingerprints are empty. The keys come from openssl; ssh-keygen
gives the OpenSSH forms (it reads no PKCS#8 Ed25519 key, so those are written here).
"""
from __future__ import annotations

import base64
import os
import struct
import subprocess
import tempfile
from pathlib import Path

ALGORITHMS = ("RSA", "ECDSA", "ED25519")
CURVES = {"P224": "P-224", "P256": "P-256", "P384": "P-384", "P521": "P-521"}
DEFAULT_RSA_BITS, DEFAULT_CURVE = 2048, "P224"


def check(inputs: dict) -> list[tuple[str, str]]:
    """(property, reason) for each input the real provider's validators refuse, in its words."""
    failures = []
    algorithm = inputs.get("algorithm")
    if algorithm is None:
        failures.append(("algorithm", 'The argument "algorithm" is required, but no definition was found.'))
    elif algorithm not in ALGORITHMS:
        failures.append(("algorithm", f"Attribute algorithm value must be one of: {_one_of(ALGORITHMS)}, "
                                      f"got: \"{algorithm}\""))
    curve = inputs.get("ecdsaCurve")
    if curve is not None and curve not in CURVES:
        failures.append(("ecdsaCurve", f"Attribute ecdsa_curve value must be one of: {_one_of(CURVES)}, "
                                       f"got: \"{curve}\""))
    return failures


def make(inputs: dict) -> dict:
    """The resource's outputs: its inputs with their defaults, and the key in every form."""
    if failures := check(inputs):
        raise ValueError("; ".join(reason for _, reason in failures))
    algorithm = inputs["algorithm"]
    state = {**inputs, "rsaBits": int(inputs.get("rsaBits") or DEFAULT_RSA_BITS),
             "ecdsaCurve": inputs.get("ecdsaCurve") or DEFAULT_CURVE}
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp, "key")
        option = {"RSA": ["-algorithm", "RSA", "-pkeyopt", f"rsa_keygen_bits:{state['rsaBits']}"],
                  "ECDSA": ["-algorithm", "EC", "-pkeyopt", f"ec_paramgen_curve:{CURVES[state['ecdsaCurve']]}",
                            "-pkeyopt", "ec_param_enc:named_curve"],
                  "ED25519": ["-algorithm", "ED25519"]}[algorithm]
        _run("openssl", "genpkey", *option, "-out", str(key))
        pkcs8 = key.read_text()
        public_pem = _run("openssl", "pkey", "-in", str(key), "-pubout")
        if algorithm == "ED25519":
            private_pem = pkcs8
            seed = _der(key, "-outform", "DER")[-32:]
            public = _der(key, "-pubout", "-outform", "DER")[-32:]
            private_openssh, public_openssh = _ed25519_openssh(seed, public)
        else:
            private_pem = _run("openssl", "pkey", "-in", str(key), "-traditional")
            private_openssh = public_openssh = ""
            if not (algorithm == "ECDSA" and state["ecdsaCurve"] == "P224"):
                key.write_text(private_pem)
                os.chmod(key, 0o600)
                public_openssh = " ".join(_run("ssh-keygen", "-y", "-f", str(key)).split()[:2]) + "\n"
                _run("ssh-keygen", "-q", "-p", "-P", "", "-N", "", "-f", str(key))  # to the OpenSSH format
                private_openssh = key.read_text()
        md5 = sha256 = ""
        if public_openssh:
            Path(tmp, "key.pub").write_text(public_openssh)
            md5 = _fingerprint(Path(tmp, "key.pub"), "md5").removeprefix("MD5:")
            sha256 = _fingerprint(Path(tmp, "key.pub"), "sha256")
    return {**state, "privateKeyPem": private_pem, "privateKeyPemPkcs8": pkcs8, "privateKeyOpenssh": private_openssh,
            "publicKeyPem": public_pem, "publicKeyOpenssh": public_openssh,
            "publicKeyFingerprintMd5": md5, "publicKeyFingerprintSha256": sha256}


def _one_of(values) -> str:
    return "[" + " ".join(f'"{v}"' for v in values) + "]"  # as the validator prints its types.String values


def _run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def _der(key: Path, *args: str) -> bytes:
    return subprocess.run(["openssl", "pkey", "-in", str(key), *args], check=True, capture_output=True).stdout


def _fingerprint(public: Path, hash_name: str) -> str:
    return _run("ssh-keygen", "-l", "-E", hash_name, "-f", str(public)).split()[1]


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _ed25519_openssh(seed: bytes, public: bytes) -> tuple[str, str]:
    """An unencrypted openssh-key-v1 private key (OpenSSH's PROTOCOL.key) and its authorized_keys line."""
    blob = _string(b"ssh-ed25519") + _string(public)
    check = os.urandom(4)
    private = check + check + blob + _string(seed + public) + _string(b"")
    private += bytes(range(1, 1 + (-len(private) % 8)))  # padding 1, 2, 3... to the cipher's block of 8
    body = b"openssh-key-v1\0" + _string(b"none") + _string(b"none") + _string(b"") + struct.pack(">I", 1)
    body += _string(blob) + _string(private)
    text = base64.b64encode(body).decode()
    lines = [text[i:i + 70] for i in range(0, len(text), 70)]
    armored = "-----BEGIN OPENSSH PRIVATE KEY-----\n" + "\n".join(lines) + "\n-----END OPENSSH PRIVATE KEY-----\n"
    return armored, f"ssh-ed25519 {base64.b64encode(blob).decode()}\n"
