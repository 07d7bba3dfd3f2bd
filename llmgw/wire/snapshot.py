"""The routing snapshot the controller publishes to gateways: its topic and version rule."""

TOPIC = b"snapshot"
