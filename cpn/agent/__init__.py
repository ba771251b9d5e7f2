"""The site agent (`cpn agent`): runs at a provider's site, dials out to the API, heartbeats the
cluster's live capacity, claims the sub-tasks placed on it and runs them through the site's driver.
It speaks to CPN only over HTTP (:mod:`cpn.client`)."""
