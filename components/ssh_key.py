"""The cluster's SSH key pair: generated (ED25519) unless the stack supplies one."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import pulumi
import pulumi_aws as aws
import pulumi_tls as tls


@dataclass
class SshKeyArgs:
    # Both or neither; with neither, a key is generated and kept only in the (encrypted) state.
    public_key: pulumi.Input[str] | None = None
    private_key: pulumi.Input[str] | None = None
    tags: Mapping[str, pulumi.Input[str]] = field(default_factory=dict)


class SshKey(pulumi.ComponentResource):
    key_name: pulumi.Output[str]
    public_key: pulumi.Output[str]
    private_key: pulumi.Output[str]  # always secret
    generated: bool

    def __init__(self, name: str, args: SshKeyArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:aws:SshKey", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)

        self.generated = args.public_key is None
        if self.generated:
            key = tls.PrivateKey(f"{name}-key", algorithm="ED25519", opts=child)
            public_key = key.public_key_openssh
            # OpenSSH encoding: pulumi-command (and ssh) cannot read ED25519 keys as PKCS#8 PEM.
            private_key = key.private_key_openssh
        else:
            public_key, private_key = args.public_key, args.private_key

        pair = aws.ec2.KeyPair(
            f"{name}-pair",
            public_key=pulumi.Output.from_input(public_key).apply(str.strip),
            tags={**args.tags, "Name": name},
            opts=child,
        )
        self.key_name = pair.key_name
        self.public_key = pair.public_key
        self.private_key = pulumi.Output.secret(private_key)
        self.register_outputs({"key_name": self.key_name, "private_key": self.private_key})
