"""The least-privilege IAM policy for the operator who runs `pulumi up`, `refresh` and `destroy`: the AWS calls
that the program's resources and lookups make through the pinned provider, in one table.

Read in terraform-provider-aws (the Create, Read, Update and Delete of each resource the program registers,
and each data source it asks; pulumi-aws 7.51.1 bridges 6.45 or later), with IAM's names for S3's calls
(HeadBucket is s3:ListBucket, GetBucketCors s3:GetBucketCORS). An S3 bucket's read asks for every bucket
setting and fails on any AccessDenied, though the program sets none of them. tests/test_operator_policy.py
fails when the program registers a type or asks a data source that has no row here, and holds
docs/reference/operator-policy.md to policy(). localswarm/fake_aws.py refuses a data source whose action an
account denies, in IAM's words.
"""
from __future__ import annotations

import json

_TAGS = ("ec2:CreateTags", "ec2:DeleteTags")

# Resource type -> the IAM actions its Create, Read, Update and Delete call.
RESOURCES: dict[str, tuple[str, ...]] = {
    "aws:ec2/instance:Instance": (
        "ec2:RunInstances", *_TAGS, "ec2:DescribeInstances", "ec2:DescribeImages", "ec2:DescribeInstanceTypes",
        "ec2:DescribeLaunchTemplates", "ec2:DescribeLaunchTemplateVersions", "ec2:DescribeTags", "ec2:DescribeVpcs",
        "ec2:DescribeInstanceAttribute", "ec2:DescribeVolumes", "ec2:DescribeInstanceCreditSpecifications",
        "ec2:DescribeSpotInstanceRequests", "ec2:ModifyInstanceAttribute", "ec2:ModifyInstanceMetadataOptions",
        "ec2:ModifyVolume", "ec2:DescribeVolumesModifications", "ec2:StopInstances", "ec2:StartInstances",
        "ec2:ModifyInstanceCapacityReservationAttributes",
        # The delete of a persistent spot node's instance cancels its request first (provider_facts.py).
        "ec2:CancelSpotInstanceRequests", "ec2:TerminateInstances",
        # The managers' instance profile, with elastic pools: launched with it, or associated in place.
        "ec2:AssociateIamInstanceProfile", "ec2:DescribeIamInstanceProfileAssociations",
        "ec2:DisassociateIamInstanceProfile", "ec2:ReplaceIamInstanceProfileAssociation", "iam:PassRole"),
    "aws:ec2/launchTemplate:LaunchTemplate": (
        "ec2:CreateLaunchTemplate", "ec2:DescribeLaunchTemplates", "ec2:DescribeLaunchTemplateVersions",
        "ec2:CreateLaunchTemplateVersion", "ec2:ModifyLaunchTemplate", "ec2:DeleteLaunchTemplate", *_TAGS),
    "aws:ec2/placementGroup:PlacementGroup": (
        "ec2:CreatePlacementGroup", "ec2:DescribePlacementGroups", "ec2:DeletePlacementGroup", *_TAGS),
    "aws:ec2/eip:Eip": ("ec2:AllocateAddress", "ec2:DescribeAddresses", "ec2:DescribeAddressesAttribute",
                        "ec2:ReleaseAddress", "ec2:DisassociateAddress", *_TAGS),
    "aws:ec2/eipAssociation:EipAssociation": ("ec2:AssociateAddress", "ec2:DescribeAddresses",
                                              "ec2:DisassociateAddress"),
    "aws:ec2/keyPair:KeyPair": ("ec2:ImportKeyPair", "ec2:DescribeKeyPairs", "ec2:DeleteKeyPair", *_TAGS),
    "aws:ec2/vpc:Vpc": ("ec2:CreateVpc", "ec2:ModifyVpcAttribute", "ec2:DescribeVpcs", "ec2:DescribeVpcAttribute",
                        "ec2:DescribeRouteTables", "ec2:DescribeNetworkAcls", "ec2:DescribeSecurityGroups",
                        "ec2:DescribeVpcEndpoints", "ec2:DeleteVpc", *_TAGS),
    "aws:ec2/subnet:Subnet": ("ec2:CreateSubnet", "ec2:ModifySubnetAttribute", "ec2:DescribeSubnets",
                              "ec2:DescribeNetworkInterfaces", "ec2:DeleteSubnet", *_TAGS),
    "aws:ec2/internetGateway:InternetGateway": (
        "ec2:CreateInternetGateway", "ec2:AttachInternetGateway", "ec2:DescribeInternetGateways",
        "ec2:DetachInternetGateway", "ec2:DeleteInternetGateway", *_TAGS),
    "aws:ec2/routeTable:RouteTable": ("ec2:CreateRouteTable", "ec2:CreateRoute", "ec2:ReplaceRoute",
                                      "ec2:DeleteRoute", "ec2:DescribeRouteTables", "ec2:DeleteRouteTable", *_TAGS),
    "aws:ec2/routeTableAssociation:RouteTableAssociation": (
        "ec2:AssociateRouteTable", "ec2:DescribeRouteTables", "ec2:ReplaceRouteTableAssociation",
        "ec2:DisassociateRouteTable"),
    "aws:ec2/securityGroup:SecurityGroup": (
        "ec2:CreateSecurityGroup", "ec2:DescribeSecurityGroups", "ec2:RevokeSecurityGroupEgress",
        "ec2:RevokeSecurityGroupIngress", "ec2:DescribeNetworkInterfaces", "ec2:DeleteSecurityGroup", *_TAGS),
    "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule": (
        "ec2:AuthorizeSecurityGroupIngress", "ec2:DescribeSecurityGroupRules", "ec2:ModifySecurityGroupRules",
        "ec2:RevokeSecurityGroupIngress", *_TAGS),
    "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule": (
        "ec2:AuthorizeSecurityGroupEgress", "ec2:DescribeSecurityGroupRules", "ec2:ModifySecurityGroupRules",
        "ec2:RevokeSecurityGroupEgress", *_TAGS),
    "aws:ec2/vpcEndpoint:VpcEndpoint": ("ec2:CreateVpcEndpoint", "ec2:DescribeVpcEndpoints", "ec2:DescribePrefixLists",
                                        "ec2:ModifyVpcEndpoint", "ec2:DeleteVpcEndpoints", *_TAGS),
    "aws:ec2/capacityReservation:CapacityReservation": ("ec2:DescribeCapacityReservations",),  # read (.get) only
    # A GPU pool's image; SSM checks an aws:ec2:image value with the caller's ec2:DescribeImages.
    "aws:ssm/parameter:Parameter": ("ssm:PutParameter", "ssm:GetParameter", "ssm:GetParameters",
                                    "ssm:DescribeParameters", "ssm:AddTagsToResource", "ssm:ListTagsForResource",
                                    "ssm:RemoveTagsFromResource", "ssm:DeleteParameter", "ec2:DescribeImages"),
    "aws:s3/bucket:Bucket": (
        "s3:CreateBucket", "s3:ListBucket", "s3:GetBucketPolicy", "s3:GetBucketAcl", "s3:GetBucketCORS",
        "s3:GetBucketWebsite", "s3:GetBucketVersioning", "s3:GetAccelerateConfiguration",
        "s3:GetBucketRequestPayment", "s3:GetBucketLogging", "s3:GetLifecycleConfiguration",
        "s3:GetReplicationConfiguration", "s3:GetEncryptionConfiguration", "s3:GetBucketObjectLockConfiguration",
        "s3:GetBucketTagging", "s3:PutBucketTagging", "s3:DeleteBucket",
        # force_destroy: the objects go with the bucket.
        "s3:ListBucketVersions", "s3:DeleteObject", "s3:DeleteObjectVersion"),
    "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock": ("s3:PutBucketPublicAccessBlock",
                                                               "s3:GetBucketPublicAccessBlock"),
    "aws:s3/bucketPolicy:BucketPolicy": ("s3:PutBucketPolicy", "s3:GetBucketPolicy", "s3:DeleteBucketPolicy"),
    "aws:s3/bucketObjectv2:BucketObjectv2": ("s3:PutObject", "s3:PutObjectTagging", "s3:GetObject",
                                             "s3:GetObjectTagging", "s3:DeleteObjectTagging", "s3:DeleteObject"),
    # An elastic pool (components/elastic_pool.py). The group launches from a template that names an instance
    # profile, so its create and update need to pass the role, and to launch and tag what the template says
    # (EC2 Auto Scaling User Guide, "Control the use of launch templates in Auto Scaling actions"). Its delete
    # with force_delete is DeleteAutoScalingGroup, then describes until it is gone (terraform-provider-aws
    # internal/service/autoscaling/group.go resourceGroupDelete). wait_for_capacity_timeout 0: no capacity wait.
    "aws:autoscaling/group:Group": (
        "autoscaling:CreateAutoScalingGroup", "autoscaling:UpdateAutoScalingGroup", "autoscaling:DeleteAutoScalingGroup",
        "autoscaling:DescribeAutoScalingGroups", "autoscaling:DescribeScalingActivities", "autoscaling:DescribeWarmPool",
        "autoscaling:SuspendProcesses", "autoscaling:ResumeProcesses", "autoscaling:CreateOrUpdateTags",
        "autoscaling:DeleteTags", "ec2:RunInstances", "ec2:CreateTags", "ec2:DescribeLaunchTemplateVersions",
        "iam:PassRole"),
    "aws:iam/role:Role": ("iam:CreateRole", "iam:GetRole", "iam:UpdateRole", "iam:UpdateAssumeRolePolicy",
                          "iam:TagRole", "iam:UntagRole", "iam:ListRolePolicies", "iam:ListAttachedRolePolicies",
                          "iam:ListInstanceProfilesForRole", "iam:DeleteRole"),
    "aws:iam/instanceProfile:InstanceProfile": (
        "iam:CreateInstanceProfile", "iam:GetInstanceProfile", "iam:AddRoleToInstanceProfile",
        "iam:RemoveRoleFromInstanceProfile", "iam:TagInstanceProfile", "iam:UntagInstanceProfile",
        "iam:DeleteInstanceProfile"),
    "aws:iam/rolePolicy:RolePolicy": ("iam:PutRolePolicy", "iam:GetRolePolicy", "iam:DeleteRolePolicy"),
}
# IAM: only the program's own roles and instance profiles (every name starts with the program's), and a role
# passed only to EC2 (the instances' profiles) or Auto Scaling (its service-linked role launches them).
IAM_RESOURCES = ("arn:aws:iam::*:role/gpu-swarm-*", "arn:aws:iam::*:instance-profile/gpu-swarm-*")
# Data source token -> the IAM actions it calls (the first is the one its AccessDenied names).
LOOKUPS: dict[str, tuple[str, ...]] = {
    "aws:ec2/getInstanceType:getInstanceType": ("ec2:DescribeInstanceTypes",),
    "aws:ec2/getInstanceTypeOfferings:getInstanceTypeOfferings": ("ec2:DescribeInstanceTypeOfferings",),
    "aws:index/getAvailabilityZones:getAvailabilityZones": ("ec2:DescribeAvailabilityZones",),
    # The images' public parameters (/aws/service/...) need no KMS.
    "aws:ssm/getParameter:getParameter": ("ssm:GetParameter",),
    "aws:ec2/getAmi:getAmi": ("ec2:DescribeImages",),
    "aws:ec2/getVpc:getVpc": ("ec2:DescribeVpcs", "ec2:DescribeVpcAttribute", "ec2:DescribeRouteTables"),
    "aws:ec2/getSubnet:getSubnet": ("ec2:DescribeSubnets",),
    "aws:ec2/getSubnets:getSubnets": ("ec2:DescribeSubnets",),
    "aws:ec2/getInstances:getInstances": ("ec2:DescribeInstances",),
    "aws:ec2/getRouteTables:getRouteTables": ("ec2:DescribeRouteTables",),
    "aws:ec2/getVpcEndpoint:getVpcEndpoint": ("ec2:DescribeVpcEndpoints", "ec2:DescribePrefixLists"),
    "aws:ec2/getCapacityBlockReservation:getCapacityBlockReservation": ("ec2:DescribeCapacityReservations",),
    # Cloud Control's IAM prefix is cloudformation; it calls the type's own read handler with the caller's
    # credentials (Service Authorization Reference, AWS Cloud Control API).
    "aws:cloudcontrol/getResource:getResource": ("cloudformation:GetResource", "ec2:DescribeCapacityReservations"),
    "aws:servicequotas/getServiceQuota:getServiceQuota": ("servicequotas:GetServiceQuota",
                                                          "servicequotas:GetAWSDefaultServiceQuota"),
    # The preview's cost table (components/cost.py): on-demand prices from the Price List, which answers in
    # us-east-1 (the program asks there), and spot prices from the spot price history. Denied, the preview warns.
    "aws:pricing/getProduct:getProduct": ("pricing:GetProducts",),
    "aws:ec2/getSpotPrice:getSpotPrice": ("ec2:DescribeSpotPriceHistory",),
}
# What every run needs: the provider asks who it is at start (its account id builds ARNs).
ALWAYS = ("sts:GetCallerIdentity",)
# The first spot launch of an account makes EC2's Spot service-linked role, which stops and starts `stop`
# nodes (EC2 User Guide, "Service-linked role for Spot Instance requests").
SPOT_ROLE = {"Sid": "SpotServiceLinkedRole", "Effect": "Allow", "Action": "iam:CreateServiceLinkedRole",
             "Resource": "arn:aws:iam::*:role/aws-service-role/spot.amazonaws.com/AWSServiceRoleForEC2Spot",
             "Condition": {"StringLike": {"iam:AWSServiceName": "spot.amazonaws.com"}}}


def actions() -> list[str]:
    """Every action the program's resources and lookups may call, sorted."""
    return sorted({*ALWAYS, *(a for row in RESOURCES.values() for a in row), *(a for row in LOOKUPS.values() for a in row)})


# The first Auto Scaling group of an account makes Auto Scaling's service-linked role, which launches and
# terminates the group's instances (EC2 Auto Scaling User Guide, "Service-linked roles for Amazon EC2 Auto Scaling").
AUTOSCALING_ROLE = {"Sid": "AutoScalingServiceLinkedRole", "Effect": "Allow", "Action": "iam:CreateServiceLinkedRole",
                    "Resource": "arn:aws:iam::*:role/aws-service-role/autoscaling.amazonaws.com/"
                                "AWSServiceRoleForAutoScaling",
                    "Condition": {"StringLike": {"iam:AWSServiceName": "autoscaling.amazonaws.com"}}}


def policy() -> dict:
    """The operator policy: one statement per service, IAM's held to the program's own roles, and the service
    roles of Spot and Auto Scaling."""
    by_service: dict[str, list[str]] = {}
    for action in actions():
        if action != "iam:PassRole":
            by_service.setdefault(action.split(":")[0], []).append(action)
    statements = [{"Sid": f"GpuSwarm{service.capitalize()}", "Effect": "Allow", "Action": names,
                   "Resource": list(IAM_RESOURCES) if service == "iam" else "*"}
                  for service, names in sorted(by_service.items())]
    passing = {"Sid": "GpuSwarmPassRole", "Effect": "Allow", "Action": "iam:PassRole", "Resource": IAM_RESOURCES[0],
               "Condition": {"StringEquals": {"iam:PassedToService": ["ec2.amazonaws.com"]}}}
    return {"Version": "2012-10-17", "Statement": [*statements, passing, SPOT_ROLE, AUTOSCALING_ROLE]}


def policy_json() -> str:
    return json.dumps(policy(), indent=2) + "\n"


if __name__ == "__main__":
    print(policy_json(), end="")
