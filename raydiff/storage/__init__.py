"""Where runs keep their files, on any storage: filesystems for paths and URIs (`fs`), a run directory (`rundir`),
local files whole or absent (`atomic`), one holder per folder (`lease`), writes off the training thread
(`writes`), and the storage errors no retry can fix (`errors`). The ground floor: it imports nothing else of
raydiff."""
