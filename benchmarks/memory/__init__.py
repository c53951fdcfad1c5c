"""Memory per rank: the loss, the Ulysses all-to-all, tensor parallelism x SP, FSDP2 against
plain FSDP2 and ZeRO-3, a long video, RL scoring."""
