"""The conductor as a Gateway API Inference Extension endpoint picker (issue 39, step 3): Envoy's external
processing (ext-proc) over gRPC, with Envoy's published protos (the ``xds-protos`` package), so a standard
gateway fronts pdserve's workers with pdserve's placement.

Modules: protocol (ext-proc messages in and out: headers, the buffered body, the picked endpoint as a header and
as ``envoy.lb`` dynamic metadata, errors as immediate responses), picker (the workers, the conductor and its
in-process index, seeded from the shared indexer; one decision per request), server (the gRPC service and its
streams), __main__ (``pdserve picker``). docs/picker.md.
"""
