"""Every object every overlay renders passes the Kubernetes API schema, strictly (an unknown or
misspelt field is an error, not ignored), with the schemas `kubernetes-validate` ships: no cluster
and no network needed.
"""

from __future__ import annotations

import copy

import pytest

from .manifests import OVERLAYS, kubectl, render

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="the test extra installs kubernetes-validate"
)

pytestmark = pytest.mark.skipif(kubectl() is None, reason="kubectl is not installed; it renders the overlays")

# The oldest Kubernetes the manifests support (the preStop `sleep` action is on by default from
# 1.30) and the newest the validator knows.
SCHEMA_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_matches_the_api_schema(overlay: str, version: str) -> None:
    for obj in render(overlay).objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:  # name the object, not only the schema path
            pytest.fail(
                f"{overlay}: {obj['kind']} {obj['metadata']['name']} fails schema {version}: {err.message}"
            )


def test_a_misspelt_field_is_refused() -> None:
    deployment = copy.deepcopy(render("cpu-demo").of_kind("Deployment")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, SCHEMA_VERSIONS[0], strict=True)
