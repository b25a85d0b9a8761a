"""Every recovery decision of runner, as pure functions of recorded facts (filled in by the reshape)."""
