"""Running the project's real code without the run: on fake tensors with the integer data kept real
(:mod:`.known_data`), booking live tensor bytes (:mod:`.live_bytes`), with collectives that need no peers
(:mod:`.sim_collectives`), on synthetic rows and one CP rank's real sequence layout (:mod:`.synthetic`)."""
