"""The node software's bundle in S3, readable only through the cluster VPC's gateway endpoint.

Nodes download it at first boot and at every upgrade (cloud-init/install.sh) with plain
HTTPS and no credential: the bucket admits anonymous reads only when they arrive through
this VPC's S3 gateway endpoint, and nothing else (Block Public Access stays on; a policy
whose only grant is tied to one endpoint is not public). The nodes check the bundle against
the sha256 pinned in their user data before they run any of it, so the bucket needs no
secrecy; the bundle is node/ as it is in this repository.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import pulumi
import pulumi_aws as aws

from settings.aws_lookups import CLUSTER_TAG
from to_node import software as node_software


@dataclass
class NodeBundleArgs:
    vpc_id: pulumi.Input[str]
    region: str
    # The route tables of the nodes' subnets, which get the endpoint's route; or an endpoint
    # the VPC already has that serves them (settings checked that it does).
    route_table_ids: Sequence[pulumi.Input[str]] = field(default_factory=list)
    existing_endpoint_id: str | None = None
    tags: Mapping[str, pulumi.Input[str]] = field(default_factory=dict)


class NodeBundle(pulumi.ComponentResource):
    sha256: str  # of the bundle's bytes: pinned in every node's release
    url: pulumi.Output[str]  # https://<bucket>.s3.<region>.amazonaws.com/<key>
    ready: list[pulumi.Resource]  # what a node's first boot needs: the object, readable, and the route to it

    def __init__(self, name: str, args: NodeBundleArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:node:Bundle", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        data = node_software.bundle()
        self.sha256 = node_software.bundle_sha256()
        key = node_software.bundle_key(self.sha256)

        # force_destroy: it holds only bundles the program can upload again.
        bucket = aws.s3.Bucket(f"{name}-bucket", force_destroy=True, tags={**args.tags, "Name": name}, opts=child)
        private = aws.s3.BucketPublicAccessBlock(
            f"{name}-private", bucket=bucket.id, block_public_acls=True, block_public_policy=True,
            ignore_public_acls=True, restrict_public_buckets=True, opts=child)
        endpoint = None
        if args.existing_endpoint_id:
            endpoint_id = pulumi.Output.from_input(args.existing_endpoint_id)
        else:
            endpoint = aws.ec2.VpcEndpoint(
                f"{name}-s3", vpc_id=args.vpc_id, service_name=f"com.amazonaws.{args.region}.s3",
                vpc_endpoint_type="Gateway", route_table_ids=list(args.route_table_ids),
                tags={**args.tags, "Name": f"{name}-s3"}, opts=child)
            endpoint_id = endpoint.id
        policy = aws.s3.BucketPolicy(
            f"{name}-policy", bucket=bucket.id,
            policy=pulumi.Output.all(bucket.arn, endpoint_id).apply(lambda v: bucket_policy(v[0], v[1])),
            # Block Public Access judges the policy as it is put: it must be in place first.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[private]))
        # One object per version, named after its content: a new version is a new object,
        # and the old one goes once this `pulumi up` has moved every node off it.
        obj = aws.s3.BucketObjectv2(
            f"{name}-{self.sha256[:12]}", bucket=bucket.id, key=key, content_type="application/x-tar",
            content_base64=base64.b64encode(data).decode(),
            # The program's own tag only: S3 takes 10 per object (settings/tag_checks.py), and object tags count
            # for no cost allocation; the bucket has the stack's tags.
            tags={k: v for k, v in args.tags.items() if k == CLUSTER_TAG}, opts=child)
        self.url = pulumi.Output.concat("https://", bucket.bucket_regional_domain_name, "/", key)
        self.ready = [obj, policy, *([endpoint] if endpoint else [])]
        self.register_outputs({"sha256": self.sha256, "url": self.url})


def bucket_policy(bucket_arn: str, endpoint_id: str) -> str:
    """Reads of the bundles through the cluster's endpoint only; no request without TLS."""
    return json.dumps({
        "Version": "2012-10-17",
        "Statement": [
            {"Sid": "NodesReadThroughTheClusterEndpoint", "Effect": "Allow", "Principal": "*",
             "Action": "s3:GetObject", "Resource": f"{bucket_arn}/node-software/*",
             "Condition": {"StringEquals": {"aws:SourceVpce": endpoint_id}}},
            {"Sid": "TlsOnly", "Effect": "Deny", "Principal": "*", "Action": "s3:*",
             "Resource": [bucket_arn, f"{bucket_arn}/*"], "Condition": {"Bool": {"aws:SecureTransport": "false"}}},
        ],
    }, sort_keys=True)
