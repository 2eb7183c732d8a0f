from sglang.srt.disaggregation.encoder.server import launch_encoder as launch_encoder
