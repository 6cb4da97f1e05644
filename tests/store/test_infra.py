"""Static checks of the deployment files (Docker and Kubernetes cannot run here)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CFN = ROOT / "infra" / "aws" / "bulkgen.cfn.yaml"
RAY = ROOT / "infra" / "kuberay" / "bulkgen-raycluster.yaml"


class _CfnLoader(yaml.SafeLoader):
    """Reads CloudFormation short tags (!Ref, !Sub, !GetAtt...) as their long form."""


def _intrinsic(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> dict:
    name = "Ref" if suffix == "Ref" else f"Fn::{suffix}"
    if isinstance(node, yaml.ScalarNode):
        value = loader.construct_scalar(node)
        return {name: value.split(".", 1) if suffix == "GetAtt" else value}
    if isinstance(node, yaml.SequenceNode):
        return {name: loader.construct_sequence(node, deep=True)}
    return {name: loader.construct_mapping(node, deep=True)}


_CfnLoader.add_multi_constructor("!", _intrinsic)


@pytest.fixture(scope="module")
def template() -> dict:
    return yaml.load(CFN.read_text(), Loader=_CfnLoader)


def _resources(template: dict, kind: str) -> dict[str, dict]:
    return {name: res for name, res in template["Resources"].items() if res["Type"] == kind}


def test_cloudformation_passes_cfn_lint():
    """cfn-lint (a test dependency) checks resource schemas, intrinsic functions and references."""
    out = subprocess.run(
        ["cfn-lint", "--format", "parseable", str(CFN)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_bucket_is_versioned_private_and_notifies_the_inbox_queue(template):
    (bucket,) = _resources(template, "AWS::S3::Bucket").values()
    props = bucket["Properties"]
    assert props["VersioningConfiguration"] == {"Status": "Enabled"}
    assert all(props["PublicAccessBlockConfiguration"].values())
    (notification,) = props["NotificationConfiguration"]["QueueConfigurations"]
    assert notification["Event"] == "s3:ObjectCreated:*"
    queue_name = notification["Queue"]["Fn::GetAtt"][0]
    assert template["Resources"][queue_name]["Type"] == "AWS::SQS::Queue"
    rules = {rule["Name"]: rule["Value"] for rule in notification["Filter"]["S3Key"]["Rules"]}
    assert rules["prefix"]["Fn::Sub"] == "${StoragePrefix}/inbox/" and rules["suffix"] == ".jsonl"
    assert bucket["DependsOn"] in _resources(template, "AWS::SQS::QueuePolicy")


def test_queue_accepts_messages_from_the_bucket_only(template):
    (policy,) = _resources(template, "AWS::SQS::QueuePolicy").values()
    (statement,) = policy["Properties"]["PolicyDocument"]["Statement"]
    assert statement["Principal"] == {"Service": "s3.amazonaws.com"}
    assert statement["Action"] == "sqs:SendMessage"
    assert "aws:SourceArn" in statement["Condition"]["ArnLike"]
    assert policy["Properties"]["Queues"] == [{"Ref": "InboxQueue"}]


def test_inbox_queue_has_a_dead_letter_queue(template):
    queue = template["Resources"]["InboxQueue"]["Properties"]
    redrive = queue["RedrivePolicy"]
    dlq = redrive["deadLetterTargetArn"]["Fn::GetAtt"]
    assert (
        dlq[1] == "Arn"
        and template["Resources"][dlq[0]]["Type"] == "AWS::SQS::Queue"
        and dlq[0] != "InboxQueue"
    )
    assert redrive["maxReceiveCount"] == {"Ref": "MaxReceiveCount"}
    assert 1 <= template["Parameters"]["MaxReceiveCount"]["Default"] <= 10
    # a failed event waits in the dead-letter queue longer than it could have waited in the inbox queue
    dlq_retention = template["Resources"][dlq[0]]["Properties"]["MessageRetentionPeriod"]
    assert dlq_retention > queue["MessageRetentionPeriod"]


def test_visibility_timeout_is_longer_than_any_allowed_job(template):
    """No arithmetic in CloudFormation: every allowed JobTimeoutMinutes maps to a longer visibility timeout."""
    param = template["Parameters"]["JobTimeoutMinutes"]
    mapping = template["Mappings"]["JobTimeouts"]
    assert set(param["AllowedValues"]) == set(mapping) and param["Default"] in mapping
    for minutes in param["AllowedValues"]:
        visibility = mapping[minutes]["VisibilitySeconds"]
        assert int(minutes) * 60 < visibility <= 43_200, minutes  # 12 h is SQS's maximum
    timeout = template["Resources"]["InboxQueue"]["Properties"]["VisibilityTimeout"]
    assert timeout == {"Fn::FindInMap": ["JobTimeouts", {"Ref": "JobTimeoutMinutes"}, "VisibilitySeconds"]}


def _actions(policy: dict) -> dict[str, set[str]]:
    """Resource (as YAML text) -> actions granted on it."""
    granted: dict[str, set[str]] = {}
    for st in policy["Properties"]["PolicyDocument"]["Statement"]:
        assert st["Effect"] == "Allow"
        actions = [st["Action"]] if isinstance(st["Action"], str) else st["Action"]
        granted.setdefault(json.dumps(st["Resource"], sort_keys=True), set()).update(actions)
    return granted


def _all_actions(policy: dict) -> set[str]:
    return set().union(*_actions(policy).values())


# The IAM actions behind each boto3 call in bulkgen/store/s3.py (multipart uploads need PutObject).
STORE_CALLS = {
    "get_object": "s3:GetObject",
    "head_object": "s3:GetObject",
    "put_object": "s3:PutObject",
    "upload_fileobj": "s3:PutObject",
    "delete_object": "s3:DeleteObject",
    "delete_objects": "s3:DeleteObject",
    "list_objects_v2": "s3:ListBucket",
    "download_file": "s3:GetObject",
}
QUEUE_CONSUMER = {
    "sqs:ReceiveMessage",
    "sqs:DeleteMessage",
    "sqs:ChangeMessageVisibility",
    "sqs:GetQueueAttributes",
}


def test_service_policy_covers_every_s3_call_the_store_makes(template):
    source = (ROOT / "bulkgen" / "store" / "s3.py").read_text()
    used = set(re.findall(r"\.(\w+)\(", source)) & set(STORE_CALLS)
    assert used == set(STORE_CALLS), f"update this table: the store calls {sorted(used)}"
    policy = template["Resources"]["ServicePolicy"]
    assert set(STORE_CALLS.values()) <= _all_actions(policy)
    assert not any(a.startswith("sqs:") for a in _all_actions(policy))  # the service never reads the queue


def test_watcher_policy_covers_the_store_under_the_prefix_and_the_queue(template):
    policy = template["Resources"]["WatcherPolicy"]
    granted = _actions(policy)
    objects = granted[json.dumps({"Fn::Sub": "${DataBucket.Arn}/${StoragePrefix}/*"})]
    assert {"s3:GetObject", "s3:PutObject", "s3:DeleteObject"} <= objects
    bucket = json.dumps({"Fn::GetAtt": ["DataBucket", "Arn"]})
    assert "s3:ListBucket" in granted[bucket]
    listing = next(
        st for st in policy["Properties"]["PolicyDocument"]["Statement"] if st["Action"] == "s3:ListBucket"
    )
    assert {"Fn::Sub": "${StoragePrefix}/*"} in listing["Condition"]["StringLike"]["s3:prefix"]
    assert QUEUE_CONSUMER <= granted[json.dumps({"Fn::GetAtt": ["InboxQueue", "Arn"]})]
    assert all(not a.endswith("*") for a in _all_actions(policy))  # no wildcard actions
    outputs = template["Outputs"]
    assert outputs["InboxUrl"]["Value"]["Fn::Sub"].endswith("/${StoragePrefix}/inbox/")
    assert outputs["InboxQueueUrl"]["Value"] == {"Ref": "InboxQueue"}
    assert outputs["WatcherPolicyArn"]["Value"] == {"Ref": "WatcherPolicy"}


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    docs = [doc for doc in yaml.safe_load_all(RAY.read_text()) if doc]
    return {doc["kind"]: doc for doc in docs}


def test_kuberay_manifest_kinds(manifests):
    assert set(manifests) == {"ServiceAccount", "RayCluster", "Service"}
    assert manifests["RayCluster"]["apiVersion"] == "ray.io/v1"


def test_head_serves_the_api_on_the_ray_cluster(manifests):
    cluster = manifests["RayCluster"]
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["block"] == "false"
    (container,) = head["template"]["spec"]["containers"]
    command = " ".join(container["command"] + container["args"])
    assert "$KUBERAY_GEN_RAY_START_CMD" in command
    assert "bulkgen serve" in command and "--ray-address auto" in command and "--port 8000" in command
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert {"name": "api", "containerPort": 8000} in container["ports"]
    service = manifests["Service"]["spec"]
    assert service["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    assert service["ports"][0]["targetPort"] == "api"


def test_gpu_worker_group_asks_for_one_gpu_per_pod(manifests):
    spec = manifests["RayCluster"]["spec"]
    (group,) = spec["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "$KUBERAY_GEN_RAY_START_CMD" in " ".join(container["args"])
    (head,) = spec["headGroupSpec"]["template"]["spec"]["containers"]
    assert container["image"] == head["image"]  # workers import the same bulkgen code
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
