"""Memory per rank: the loss, the Ulysses all-to-all, tensor parallelism x SP, a long video, RL scoring."""
