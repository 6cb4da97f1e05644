"""Know before you run: a file's work and time (`bulkgen plan`), the throughput profile it is computed
from (`bulkgen profile`), and the estimate and window check every batch gets at validation (admission)."""
