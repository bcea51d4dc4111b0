"""The gRPC stubs are generated from the .proto, never edited: stale stubs fail the suite."""

from __future__ import annotations

from protos.generate import stale_stubs


def test_generated_stubs_match_the_proto() -> None:
    assert stale_stubs() == [], "run `python -m protos.generate` (make venv does) after editing serving.proto"


def test_the_contract_has_the_service_and_its_methods() -> None:
    from protos.kvserve.v1 import serving_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["KVServe"]
    assert service.full_name == "kvserve.v1.KVServe"
    assert {m.name for m in service.methods} >= {"Generate", "Submit", "Stream", "Cancel", "GetRequest", "ClusterStatus"}
