"""gpu-swarm:tags, checked against what every service that gets them takes, before anything is made.

The program tags what it makes with the stack's tags and its own (OWN_TAGS), and the provider adds the
provider's default tags (aws:defaultTags) to every resource it tags. Each service has its own limits, and
the resource that would refuse a set is named here, at preview, rather than by AWS in the middle of `up`:
- EC2 (instances, their root volumes, Elastic IPs, the network, groups, templates): 50 tags per resource,
  keys up to 128 characters and values up to 256, the aws: prefix reserved (EC2 User Guide, "Tag
  restrictions");
- an S3 bucket: 50 tags, the same lengths, and only letters, digits, spaces and + - = . _ : / @ (S3 User
  Guide, "Using cost allocation S3 bucket tags");
- an S3 object: 10 tags (S3 User Guide, "Categorizing your objects using tags"). The node software's bundle
  takes only the program's own tag, so no stack tag can push it over; the provider's default tags still
  reach it, and are counted.
"""
from __future__ import annotations

import re

import pulumi

from settings.aws_lookups import CLUSTER_TAG, OWN_TAGS
from settings.reader import PROJECT, Reader, key

EC2_TAGS, S3_BUCKET_TAGS, S3_OBJECT_TAGS = 50, 50, 10
KEY_CHARS, VALUE_CHARS = 128, 256
# S3's tag characters: Unicode letters and digits, spaces, and + - = . _ : / @.
S3_TAG_TEXT = re.compile(r"[\w\s+=.:/@-]*")


def provider_default_tags() -> dict[str, str]:
    """aws:defaultTags's tags, which the provider merges into every resource's tags (tags_all)."""
    found = pulumi.Config("aws").get_object("defaultTags") or {}
    return {str(k): str(v) for k, v in (found.get("tags") or {}).items()} if isinstance(found, dict) else {}


def read_tags(r: Reader) -> tuple[tuple[str, str], ...]:
    raw = r.json("tags", dict, "pulumi config set --path 'tags.team' ml-platform")
    tags = []
    for name, value in sorted((raw or {}).items()):
        if name.lower().startswith("aws:"):
            r.error("tags", f"{name!r}: the aws: prefix is reserved by AWS; choose another key")
        elif name in OWN_TAGS or name.startswith(f"{PROJECT}:"):
            r.error("tags", f"{name!r} is set by {PROJECT} on every resource; choose another key")
        elif not isinstance(value, (str, int, float)) or isinstance(value, bool):
            r.error("tags", f"{name!r}: tag values must be text, found {value!r}")
        elif len(name) > KEY_CHARS or len(str(value)) > VALUE_CHARS:
            r.error("tags", f"{name!r}: AWS takes keys up to {KEY_CHARS} and values up to {VALUE_CHARS} characters")
        elif not S3_TAG_TEXT.fullmatch(name) or not S3_TAG_TEXT.fullmatch(str(value)):
            r.error("tags", f"{name!r}: the node software's S3 bucket takes only letters, digits, spaces and "
                            "+ - = . _ : / @ in tag keys and values; remove the other characters")
        else:
            tags.append((name, str(value)))
    check_counts(r, dict(tags), provider_default_tags())
    return tuple(tags)


def check_counts(r: Reader, tags: dict[str, str], defaults: dict[str, str]) -> None:
    """Each resource's tags, the stack's, the provider's defaults and the program's own, within its service's limit."""
    merged = {**defaults, **tags}  # a stack tag overrides a default tag of the same key (tags_all)
    if len(merged) + len(OWN_TAGS) > EC2_TAGS:
        r.error("tags", f"{len(merged)} tags ({len(tags)} here, {len(defaults)} from aws:defaultTags), and "
                        f"{PROJECT} adds {len(OWN_TAGS)} of its own ({', '.join(OWN_TAGS)}) to each node: EC2 takes "
                        f"{EC2_TAGS} per resource, so aws.ec2.Instance would refuse them; keep at most "
                        f"{EC2_TAGS - len(OWN_TAGS)} in all")
    if len(defaults) + 1 > S3_OBJECT_TAGS:
        r.error("tags", f"aws:defaultTags has {len(defaults)} tags, which the provider adds to every resource, and "
                        f"S3 takes {S3_OBJECT_TAGS} per object: the node software's bundle (aws.s3.BucketObjectv2, with "
                        f"{PROJECT}'s own {CLUSTER_TAG}) would be refused; keep at most {S3_OBJECT_TAGS - 1} default "
                        f"tags, and put the others in {key('tags')} (the bundle does not take those)")
